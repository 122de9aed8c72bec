"""Usage you can bill (issue 41): every finished job adds its prompt, completion and cached
tokens and a job count to its namespace's per-model, per-UTC-day counters, in the script that
finishes it, so a retried or reclaimed job is counted once (the kill -9 case is asserted in
tests/test_faults_crash.py). `conveyor usage` prints them; what a producer scribbles over the
counters neither stops a replica nor is read as usage."""

import datetime
import json

from replica_harness import ReplicaThread
from usage_days import usage_since

from conveyor import cli as conveyor_cli
from conveyor.clients import Client
from conveyor.clients.events import DoneEvent, Usage, encode_event
from conveyor.clients.job_record import FINISH_LUA, START_LUA
from conveyor.clients.keys import Keys
from conveyor.clients.usage import MAX_USAGE_FIELDS, read_usage, usage_day, usage_increments

TODAY = datetime.datetime.now(datetime.timezone.utc).date()


def since_today(client):
    return usage_since(client.redis, client.keys, TODAY)


def test_usage_equals_the_sum_of_the_jobs_own_usage(tiny_model, redis_url, namespace, capsys):
    with ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4) as running:
        model = running.replica.model_name
        client = Client(redis_url, namespace=namespace)
        try:
            prompts = [list(range(5, 90)), list(range(5, 90)), list(range(7, 30)), [3, 4, 5]]
            results = [
                client.submit(prompt_token_ids=p, max_tokens=3 + i, temperature=0).result(timeout=60)
                for i, p in enumerate(prompts)
            ]
            rows, skipped = since_today(client)
        finally:
            client.close()
    assert not skipped and [r.model for r in rows] == [model]
    [row] = rows
    assert row.jobs == 4
    assert row.prompt_tokens == sum(r.usage.prompt_tokens for r in results)
    assert row.completion_tokens == sum(r.usage.completion_tokens for r in results) == 3 + 4 + 5 + 6
    assert row.cached_tokens == sum(r.usage.cached_tokens for r in results) > 0, "the repeated prompt hit the cache"
    flags = ["--redis-url", redis_url, "--namespace", namespace, "--json", "--start", TODAY.isoformat()]
    assert conveyor_cli.main(["usage", *flags]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == [row.as_dict()] and printed["totals"]["jobs"] == 4


def finish(raw, keys: Keys, job_id: str, attempt: int, usage: Usage, model: str = "m") -> int:
    data = encode_event(DoneEvent(attempt=attempt, finish_reason="length", usage=usage))["data"]
    usage_key = keys.usage_of(job_id, usage_day(1e9 + 1))
    counts = usage_increments(model, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
    return raw.eval(
        FINISH_LUA, 4, keys.job(job_id), keys.out(job_id), keys.interactive, usage_key,
        attempt, "done", "done", data, 600, "engines", "1-1", "1", 600, *counts,
    )  # fmt: skip


def start(raw, keys: Keys, job_id: str) -> int:
    return raw.eval(START_LUA, 2, keys.job(job_id), keys.out(job_id), "1-1", 600, "0", "")[0]


def day_usage(raw, keys: Keys):
    day = datetime.date.fromisoformat(usage_day(1e9 + 1))
    return read_usage(raw, keys, day, day)


def test_a_job_is_counted_once_by_the_attempt_that_finishes_it(raw, namespace):
    keys = Keys(namespace)
    used = Usage(prompt_tokens=10, completion_tokens=4, total_tokens=14, cached_tokens=8)
    assert start(raw, keys, "j") == 1 and start(raw, keys, "j") == 2  # attempt 1 reclaimed: attempt 2 runs
    assert finish(raw, keys, "j", 1, used) == 0, "the stale attempt is fenced off"
    assert finish(raw, keys, "j", 2, used) == 1
    assert finish(raw, keys, "j", 2, used) == 1, "a retried write after a lost reply"
    rows, skipped = day_usage(raw, keys)
    assert not skipped
    assert [(r.jobs, r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in rows] == [(1, 10, 4, 8)]


def test_scribbled_counters_restart_and_oversized_hashes_are_skipped(raw, namespace):
    keys = Keys(namespace)
    key = keys.usage_of("a", usage_day(1e9 + 1))
    raw.set(key, "not a hash")
    start(raw, keys, "a")
    assert finish(raw, keys, "a", 1, Usage(prompt_tokens=5, completion_tokens=1)) == 1, "a wrong type is reset"
    raw.hset(key, "completion_tokens:m", "lots")
    start(raw, keys, "b")
    assert finish(raw, keys, "b", 1, Usage(prompt_tokens=7, completion_tokens=2)) == 1, "a non-count restarts"
    [row], _ = day_usage(raw, keys)
    assert (row.jobs, row.prompt_tokens, row.completion_tokens) == (2, 12, 2)
    raw.hset(key, mapping={f"jobs:model-{i}": 1 for i in range(MAX_USAGE_FIELDS + 1)})
    rows, skipped = day_usage(raw, keys)
    assert rows == [] and skipped == [key]


def test_a_cancelled_job_is_billed_for_what_it_was_served(tiny_model, redis_url, namespace):
    """A client may stream every token and cancel before the end: the usage counters still
    count what the engine served."""
    from conveyor.clients.errors import JobCancelled

    with ReplicaThread(tiny_model, redis_url, namespace, max_num_seqs=4):
        client = Client(redis_url, namespace=namespace)
        try:
            job = client.submit(prompt_token_ids=[5, 6, 7, 8], max_tokens=900, temperature=0, ignore_eos=True)
            streamed = 0
            for event in job.stream(timeout=60):
                streamed += len(event.token_ids)
                if streamed >= 20:
                    break
            assert job.cancel()
            try:
                job.result(timeout=60)
            except JobCancelled:
                pass
            [row], _ = since_today(client)
        finally:
            client.close()
    assert row.jobs == 1 and row.prompt_tokens == 4 and 20 <= row.completion_tokens < 900
