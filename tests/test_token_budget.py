"""A daily token budget per namespace (issue 41): once the day's prompt + completion tokens
reach the operator's `--token-budget`, submits are refused until midnight UTC with an error
naming the budget and when it resets, and the gateway answers 429 in OpenAI's shape."""

import datetime
import time

import openai
import pytest
from fault_harness import wait_until
from gateway_harness import GatewayThread, openai_client
from replica_harness import ReplicaThread

from conveyor.clients import Client, QuotaExceeded
from conveyor.clients.errors import JobFailed
from conveyor.clients.keys import Keys


def test_a_spent_budget_refuses_submits_until_midnight_utc(tiny_model, redis_url, namespace, raw):
    replica = ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4)
    replica.config.token_budget = 50
    limits = Keys(namespace).limits_of(0)
    client = Client(redis_url, namespace=namespace)
    try:
        with replica:
            job = dict(prompt_token_ids=list(range(5, 35)), max_tokens=30, temperature=0, ignore_eos=True)
            assert client.submit(**job).result(timeout=60).usage.total_tokens == 60  # within budget when sent
            flagged = lambda: int(raw.hget(limits, "budget_reset_at") or 0) > time.time()  # noqa: E731
            wait_until(flagged, 30, "the replica to flag the spent budget (its next beat)")
            tomorrow = datetime.datetime.now(datetime.timezone.utc).date() + datetime.timedelta(days=1)
            with pytest.raises(QuotaExceeded, match=f"token_budget in {limits}.*resets at {tomorrow}T00:00:00Z"):
                client.submit(**job)
            with GatewayThread(redis_url, namespace=namespace) as gateway, openai_client(gateway) as sdk:
                with pytest.raises(openai.RateLimitError) as refused:
                    sdk.completions.create(model=replica.replica.model_name, prompt="x", max_tokens=2)
            assert refused.value.status_code == 429 and refused.value.code == "insufficient_quota"
            assert refused.value.body["type"] == "insufficient_quota"
            # a producer may clear the flag in the limits hash (it can write it): intake refuses too
            bypass = None
            while bypass is None:  # the replica rewrites the flag every beat: clear it right before
                raw.hset(limits, "budget_reset_at", 0)
                try:
                    bypass = client.submit(**job)
                except QuotaExceeded:
                    pass
            with pytest.raises(JobFailed, match="token budget .*50 tokens.*resets at"):
                bypass.result(timeout=60)
    finally:
        client.close()
    assert int(raw.hget(limits, "token_budget")) == 50


def test_scribbled_limits_neither_block_nor_break_submits(redis_url, namespace, raw):
    """Producers can write the limits hash: a budget flag that is not a time, lies more than
    the day a budget lasts ahead, or is past, refuses nothing; a limits key of another type
    fails no submit."""
    keys = Keys(namespace)
    limits = keys.limits_of(0)
    with Client(redis_url, namespace=namespace) as client:
        for junk in ("soon", "-5", "1e999", "x" * 10_000, str(int(time.time()) - 60), str(int(time.time()) + 90_000)):
            raw.hset(limits, "budget_reset_at", junk)
            assert client.submit(prompt="hi", max_tokens=1).enqueued, junk
        raw.delete(limits)
        raw.set(limits, "not a hash")
        assert client.submit(prompt="hi", max_tokens=1).enqueued
