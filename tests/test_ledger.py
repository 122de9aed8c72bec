"""The job ledger actor on its own, against a real Valkey: credits and bytes, a release
waking ingest's wait for credits, reclaimed entries sent to ingest's mailbox, cancels
forwarded only for held jobs, drain and hand-back. Ingest and the engine-core actor are bare
actors whose mailboxes the tests read (the ledger under test is the real one)."""

import asyncio

import redis.asyncio as aioredis

from conveyor.actors.base import Actor
from conveyor.actors.config import ReplicaConfig
from conveyor.actors.ledger import JobLedger
from conveyor.actors.messages import (
    AbortJob,
    CancelRequest,
    Delivery,
    Drain,
    EntryDone,
    HandBack,
    HeldJobs,
    ReadEntry,
    Reclaimed,
    Release,
    WantCredits,
)
from conveyor.actors.streams import Streams
from conveyor.clients.job_record import START_LUA
from conveyor.clients.keys import GROUP, Keys

WAIT_S = 5.0


class Inbox(Actor):
    """An actor that is never started: what the ledger sends it stays in its mailbox."""

    mailbox_size = 0


def run(redis_url: str, namespace: str, scenario, **config) -> None:
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        streams = Streams(client, Keys(namespace), "ledger-test", "m", max_entry_bytes=1 << 20)
        await streams.ensure_groups()
        options = {"lease_s": 30.0, "max_bytes_in_flight": 1000, **config}
        ledger = JobLedger(
            streams, ReplicaConfig(redis_url=redis_url, namespace=namespace, **options), options.pop("capacity", 2)
        )
        ingest, engine_core = Inbox(), Inbox()
        ledger.connect(ingest, engine_core)
        ledger.start()
        try:
            await asyncio.wait_for(scenario(ledger, ingest, engine_core, streams), 60)
        finally:
            await ledger.stop()
            await streams.close()

    asyncio.run(main())


async def granted(request: WantCredits, timeout: float = WAIT_S):
    return await asyncio.wait_for(asyncio.shield(request.reply), timeout)


async def still_waiting(request: WantCredits) -> bool:
    await asyncio.sleep(0.2)
    return not request.reply.done()


def delivery(job_id: str, size: int = 10, stream: str = "s", entry_id: str | None = None) -> Delivery:
    return Delivery(stream, entry_id or f"1-{job_id}", job_id, attempt=1, size=size)


def read(entry_id: str, size: int = 0, stream: str = "s") -> ReadEntry:
    return ReadEntry(stream, entry_id, size, False, {})


def test_credits_and_bytes_bound_the_grant_and_a_release_wakes_the_waiting_ingest(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        first = WantCredits()
        await ledger.send(first)
        assert await granted(first) == (2, 1000)  # everything free, reserved for this read
        ledger.entries_read([read("1-a"), read("1-b")])
        ledger.track(delivery("a", size=400))  # its entry's bytes move from intake to held: counted once
        second = WantCredits()
        await ledger.send(second)
        assert await still_waiting(second)  # a held, b still being taken in: no credit
        await ledger.send(EntryDone("s", "1-b"))  # b refused: its credit is free again
        assert await granted(second) == (1, 600)
        ledger.entries_read([read("1-c")])
        ledger.track(delivery("c", size=600))
        third = WantCredits()
        await ledger.send(third)
        assert await still_waiting(third)  # no credit and no bytes
        await ledger.send(Release(delivery("a", size=400)))
        assert await granted(third) == (1, 400)
        ledger.entries_read([])
        await ledger.send(Release(delivery("c", size=600, entry_id="2-c")))  # another entry: not ours, kept
        assert await ledger.ask(HeldJobs()) == ["c"]

    run(redis_url, namespace, scenario)


def test_a_started_entry_counts_its_bytes_once(redis_url, namespace):
    """Tracking a delivery moves its entry's bytes from intake to held in the same step:
    no moment where they count twice, and no message ingest must send or wait for."""

    async def scenario(ledger, ingest, engine_core, streams):
        first = WantCredits()
        await ledger.send(first)
        assert await granted(first) == (2, 1000)
        ledger.entries_read([read("1-a", size=400)])
        ledger.track(delivery("a", size=400))
        second = WantCredits()
        await ledger.send(second)
        assert await granted(second) == (1, 600)

    run(redis_url, namespace, scenario)


def test_bytes_alone_hold_the_grant_back(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        ledger.track(delivery("big", size=1000))
        request = WantCredits()
        await ledger.send(request)
        assert await still_waiting(request)  # a credit is free, no byte is
        await ledger.send(Release(delivery("big", size=1000)))
        assert await granted(request) == (2, 1000)

    run(redis_url, namespace, scenario)


def test_entries_being_taken_in_or_refused_hold_their_bytes_until_done(redis_url, namespace):
    """A refused entry's payload stays in memory until the publisher has dead-lettered it
    (it then sends EntryDone): until then its bytes count, or a flood of large invalid
    entries would pile up in the publisher's mailbox unbounded by --max-bytes-in-flight."""

    async def scenario(ledger, ingest, engine_core, streams):
        first = WantCredits()
        await ledger.send(first)
        assert await granted(first) == (2, 1000)
        ledger.entries_read([read("1-big", size=1000)])
        second = WantCredits()
        await ledger.send(second)
        assert await still_waiting(second)  # a credit is free, but its bytes are all in the refused entry
        await ledger.send(EntryDone("s", "1-big"))
        assert await granted(second) == (2, 1000)
        truncated = ReadEntry("s", "1-huge", 50_000_000, True, {b"data": b"x" * 90})
        ledger.entries_read([truncated])  # only its stub is in memory: 94 bytes count
        third = WantCredits()
        await ledger.send(third)
        assert await granted(third) == (1, 906)

    run(redis_url, namespace, scenario)


def test_a_dead_consumers_entry_is_reclaimed_into_ingests_mailbox_with_its_credit(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        stream = streams.request_streams[0]
        entry_id = (await streams.redis.xadd(stream, {"data": b"payload"})).decode()
        await streams.redis.xreadgroup(GROUP, "dead-replica", {stream: ">"}, count=1)
        message = await asyncio.wait_for(ingest.mailbox.get(), WAIT_S)
        assert isinstance(message, Reclaimed)
        assert (message.entry.stream, message.entry.entry_id, message.entry.fields) == (
            stream,
            entry_id,
            {b"data": b"payload"},
        )
        [row] = await streams.redis.xpending_range(stream, GROUP, "-", "+", 10)
        assert row["consumer"] == b"ledger-test"
        request = WantCredits()
        await ledger.send(request)
        assert await granted(request) == (1, 1000 - message.entry.size)  # the reclaimed entry holds a credit
        ledger.entries_read([])
        await asyncio.sleep(0.5)  # more reclaim rounds: renewed as ours, not sent again
        assert ingest.mailbox.empty()

    run(redis_url, namespace, scenario, lease_s=0.3)


def test_an_entry_of_a_held_job_waits_for_its_release_holding_a_credit(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        ledger.track(delivery("a", size=10))
        assert ledger.may_start("b", ReadEntry("s", "1-b", 5, False, {})) is True
        requeued = ReadEntry("s", "2-a", 5, False, {b"data": b"x"})  # e.g. requeued as its old attempt ends
        ledger.entries_read([requeued])
        assert ledger.may_start("a", requeued) is False
        request = WantCredits()
        await ledger.send(request)
        await asyncio.sleep(0.2)
        assert not request.reply.done() and ingest.mailbox.empty()  # a held, the requeued entry parked
        await ledger.send(Release(delivery("a", size=10)))
        assert (await asyncio.wait_for(ingest.mailbox.get(), WAIT_S)) == Reclaimed(requeued)
        assert await granted(request) == (1, 995)  # the requeued entry still takes one (in intake again)

    run(redis_url, namespace, scenario)


def test_cancels_go_to_the_engine_core_actor_only_for_held_jobs_and_once(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        assert await ledger.ask(CancelRequest("not-here")) is False
        ledger.track(delivery("held"))
        assert await ledger.ask(CancelRequest("held")) is True
        assert await ledger.ask(CancelRequest("held")) is True
        assert engine_core.mailbox.get_nowait() == AbortJob("held", "cancelled")
        assert engine_core.mailbox.empty()  # the flood's second request went no further
        await ledger.send(Release(delivery("held")))
        assert await ledger.ask(CancelRequest("held")) is False
        assert engine_core.mailbox.empty()

    run(redis_url, namespace, scenario)


def test_drain_is_answered_by_the_last_release(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        ledger.track(delivery("a"))
        ledger.track(delivery("b"))
        drained = asyncio.ensure_future(ledger.ask(Drain()))
        await ledger.send(Release(delivery("a")))
        await asyncio.sleep(0.2)
        assert not drained.done()
        await ledger.send(Release(delivery("b")))
        await asyncio.wait_for(drained, WAIT_S)

    run(redis_url, namespace, scenario)


def test_hand_back_queues_only_our_attempt_and_frees_every_pending_entry(redis_url, namespace):
    async def scenario(ledger, ingest, engine_core, streams):
        stream, keys = streams.request_streams[0], streams.keys
        held = []
        for job_id in ("ours", "reclaimed-by-another"):
            entry_id = (await streams.redis.xadd(stream, {"data": b"x"})).decode()
            await streams.redis.xreadgroup(GROUP, "ledger-test", {stream: ">"}, count=1)
            await streams.redis.eval(START_LUA, 2, keys.job(job_id), keys.out(job_id), entry_id, 60, "0", "")
            held.append(Delivery(stream, entry_id, job_id, attempt=1))
            ledger.track(held[-1])
        await streams.redis.hset(keys.job("reclaimed-by-another"), "attempt", 2)  # a newer owner's
        await streams.redis.xadd(stream, {"data": b"read, never recorded"})
        await streams.redis.xreadgroup(GROUP, "ledger-test", {stream: ">"}, count=1)
        await ledger.ask(HandBack())
        assert await streams.redis.hget(keys.job("ours"), "status") == b"queued"
        assert await streams.redis.hget(keys.job("reclaimed-by-another"), "status") == b"running"
        rows = await streams.redis.xpending_range(stream, GROUP, "-", "+", 10)
        assert len(rows) == 3 and all(row["time_since_delivered"] > 10**9 for row in rows)  # claimable at once
        assert await ledger.ask(HeldJobs()) == []

    run(redis_url, namespace, scenario)
