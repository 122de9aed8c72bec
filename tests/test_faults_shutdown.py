"""Fault injection, shutdown: SIGTERM to a replica under load. It stops reading, finishes
what it can within its grace period, hands the rest back (their pending entries made
"idle forever", so the next XAUTOCLAIM anywhere takes them at once) and exits 0."""

from __future__ import annotations

import re
import subprocess

import pytest
import redis
from fault_harness import (
    JobLedger,
    check_attempt_sequences,
    pending_details,
    pending_owners,
    record,
    spawner_fixture,
    wait_until,
)

from conveyor.clients import Client
from conveyor.clients.keys import Keys

GRACE_S = 2.0
LEASE_S = 4.0
HANDED_BACK_IDLE_MS = 10**9  # streams.HAND_BACK_IDLE_MS is ten years; anything this idle was handed back


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(request, tmp_path, redis_url, engine_process=True)


@pytest.mark.slow
def test_sigterm_under_load_finishes_or_hands_back_every_job_and_exits_0(spawn, tiny_model, redis_url, namespace):
    raw = redis.Redis.from_url(redis_url)
    client, ledger, stream = (
        Client(redis_url, namespace=namespace),
        JobLedger(raw, namespace),
        Keys(namespace).interactive,
    )
    leaving = spawn(namespace, "term-old", tiny_model, lease_s=LEASE_S, grace_s=GRACE_S).start().wait_ready()
    short = client.submit_many(
        [{"prompt_token_ids": [5, 6, i], "max_tokens": 30, "ignore_eos": True, "temperature": 0} for i in range(20)],
        progress=False,
    )
    long = client.submit_many(
        [{"prompt_token_ids": [5, 7, i], "max_tokens": 600, "ignore_eos": True, "temperature": 0} for i in range(20)],
        progress=False,
    )
    ids = [job.job_id for job in short + long]
    long_ids = [job.job_id for job in long]
    wait_until(lambda: all(r.tokens for r in ledger.records(long_ids).values()), 60, "the replica to run the jobs")
    assert set(pending_owners(raw, namespace).values()) == {leaving.consumer}

    leaving.sigterm()  # a rolling update: the new replica starts as the old one drains
    arriving = spawn(namespace, "term-new", tiny_model, lease_s=LEASE_S).start()
    try:
        code = leaving.wait(GRACE_S + 20)
    except subprocess.TimeoutExpired:  # see test_actor_stop_stops_an_actor_that_is_talking_to_redis
        raise AssertionError("the SIGTERMed replica did not exit: an actor ignored its cancellation") from None
    assert code == 0, f"exit code of a SIGTERMed replica:\n{leaving.log_tail()}"
    left = {_text(p["message_id"]): p for p in pending_details(raw, stream)}
    assert all(
        p["time_since_delivered"] >= HANDED_BACK_IDLE_MS or _text(p["consumer"]) == arriving.consumer
        for p in left.values()
    ), f"unfinished entries not handed back: {list(left.values())[:3]}"
    arriving.wait_ready()
    ledger.wait_finished(ids, 120)

    records = ledger.records(ids)
    for rec in records.values():
        assert [e.type for e in rec.terminals] == ["done"], (rec.job_id, rec.terminals)
        check_attempt_sequences(rec)
    finished_in_grace = [r for r in records.values() if r.attempt == 1]
    handed_back = [r for r in records.values() if r.attempt == 2]
    assert len(finished_in_grace) + len(handed_back) == 40
    assert all(records[job.job_id].attempt == 1 for job in short), "short jobs fit in the grace period"
    assert handed_back, "600-token jobs cannot finish within the grace period"
    logged = re.search(r"handed back (\d+) unfinished jobs", leaving.log_text())
    assert logged and int(logged.group(1)) >= len(handed_back) == len(left)
    assert sorted(arriving.reclaimed_entries()) == sorted(left), "the new replica takes what was handed back"
    summary = ledger.summary(ids)
    record(
        "SIGTERM under load (rolling update)",
        **summary,
        finished_within_grace=len(finished_in_grace),
        handed_back=len(handed_back),
        exit_code=0,
    )
    assert summary["lost"] == 0 and summary["duplicates"] == 0
    raw.close()


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


@pytest.mark.slow
def test_sigterm_during_an_intake_burst_hands_back_every_entry_it_read(spawn, tiny_model, redis_url, namespace):
    raw = redis.Redis.from_url(redis_url)
    stream = Keys(namespace).interactive
    replica = spawn(namespace, "term-burst", tiny_model, grace_s=1.0).start().wait_ready()  # default lease 30 s
    # prompts slow to tokenize, so the ingest actor is still accepting its first read when SIGTERM comes
    Client(redis_url, namespace=namespace).submit_many(
        [{"prompt": f"def f(x): return x + {i}\n" * 300, "max_tokens": 2} for i in range(400)], progress=False
    )
    wait_until(lambda: raw.xpending(stream, "engines")["pending"] > 0, 30, "the first read", interval=0.005)
    replica.sigterm()
    try:
        code = replica.wait(GRACE_S + 10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the replica did not exit within {GRACE_S + 10:.0f} s of SIGTERM") from None
    left = pending_details(raw, stream)
    stuck = [p for p in left if p["time_since_delivered"] < HANDED_BACK_IDLE_MS]
    raw.close()
    assert code == 0
    assert not stuck, f"{len(stuck)} of {len(left)} pending entries were not handed back"


def test_actor_stop_stops_an_actor_that_is_talking_to_redis(redis_url):
    import asyncio

    import redis.asyncio as aioredis

    from conveyor.actors.base import Actor

    class Chatty(Actor):
        """An actor whose loop is all Redis round trips, like the ingest and lease actors."""

        name = "chatty"

        def __init__(self, client) -> None:
            super().__init__()
            self.client, self.halt = client, False

        async def run(self) -> None:  # loops check `stopped`, as every actor of a replica does
            while not (self.halt or self.stopped):
                await self.client.ping()

    async def stop_many_times() -> int | None:
        client = aioredis.Redis.from_url(redis_url)  # as actors/replica.py creates it
        try:
            for cycle in range(300):
                actor = Chatty(client)
                actor.start()
                await asyncio.sleep(0.001 * (cycle % 7))
                stopping = asyncio.ensure_future(actor.stop())
                done, _ = await asyncio.wait({stopping}, timeout=1.0)
                if not done:
                    actor.halt = True  # let the runaway task end so the loop can close
                    await stopping
                    return cycle
            return None
        finally:
            await client.aclose()

    hung_at = asyncio.run(stop_many_times())
    assert hung_at is None, f"Actor.stop() did not stop the actor (cycle {hung_at}): its cancellation was lost"
