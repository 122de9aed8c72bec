"""Leases: which request entries this replica holds, keeping them alive, and reclaiming
entries whose owner stopped renewing (a crashed replica).

The lease measures how fast a crash is noticed, never how long a job may run: in-flight
entries are re-claimed by their owner (XCLAIM ... JUSTID resets their idle time) every
third of the lease, however long the job takes.
"""
import asyncio
import logging
from typing import Awaitable, Callable

from redis.exceptions import ResponseError

from actors.base import Actor
from actors.config import ReplicaConfig
from actors.log_limits import RateLimitedLog, shown
from actors.messages import Delivery
from actors.streams import ReadEntry, Streams
from clients.keys import GROUP

log = logging.getLogger(__name__)
HAND_BACK_IDLE_MS = 10 * 365 * 86_400_000  # "idle forever": the next XAUTOCLAIM takes it
RECLAIM_BATCH = 64  # entries taken over per stream per reclaim round


class Leases(Actor):
    name = "leases"

    def __init__(self, streams: Streams, config: ReplicaConfig, capacity: int):
        super().__init__()
        self.streams = streams
        self.config = config
        self.capacity = capacity
        self.held: dict[str, Delivery] = {}  # job id -> delivery
        self.bytes_held = 0  # sum of the held deliveries' entry sizes
        self.intake: set[tuple[str, str]] = set()  # (stream, entry id) read, not yet accepted
        self.credit_freed = asyncio.Event()
        self.reclaim_handler: Callable[[ReadEntry], Awaitable[None]] | None = None
        self.reclaiming = True
        self.warnings = RateLimitedLog(log)

    # ---- bookkeeping (called by ingest and publisher, same event loop) ----------------
    def free_credits(self) -> int:
        return self.capacity - len(self.held) - len(self.intake)

    def free_bytes(self) -> int:
        return self.config.max_bytes_in_flight - self.bytes_held

    def holds(self, job_id: str) -> bool:
        return job_id in self.held

    def track(self, delivery: Delivery) -> None:
        assert delivery.job_id not in self.held, delivery.job_id
        self.held[delivery.job_id] = delivery
        self.bytes_held += delivery.size

    def release(self, delivery: Delivery) -> None:
        if self.held.get(delivery.job_id) is delivery:
            del self.held[delivery.job_id]
            self.bytes_held -= delivery.size
            self.credit_freed.set()

    # ---- the actor loop ----------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_reclaim = loop.time()
        while not self.stopped:
            try:
                await self.renew()
                if self.reclaiming and loop.time() >= next_reclaim:
                    await self.reclaim()
                    next_reclaim = loop.time() + self.config.reclaim_interval_s
            except ResponseError as exc:  # e.g. a producer replaced a request stream by another type
                self.warnings.warning("leases", "renew/reclaim failed: %s", shown(str(exc), 200))
            await asyncio.sleep(self.config.renew_interval_s)

    async def renew(self) -> None:
        for stream, ids in self._ids_by_stream().items():
            await self.streams.resilient(lambda: self.streams.redis.xclaim(
                stream, GROUP, self.streams.consumer, 0, ids, justid=True), "renew leases")

    async def reclaim(self) -> None:
        """Take over entries idle longer than the lease (their owner died) and rerun them."""
        min_idle_ms = int(self.config.lease_s * 1000)
        for stream in self.streams.request_streams:
            count = min(self.free_credits(), RECLAIM_BATCH)
            if count <= 0 or self.free_bytes() <= 0 or self.reclaim_handler is None:
                return
            # ids only: the entries themselves come through the size-bounded read. (Entries
            # deleted while pending leave the pending list with this call: Redis >= 7.)
            claimed = await self.streams.resilient(lambda: self.streams.redis.xautoclaim(
                stream, GROUP, self.streams.consumer, min_idle_ms, start_id="0-0", count=count, justid=True),
                "reclaim")
            entry_ids = [entry_id.decode() if isinstance(entry_id, bytes) else entry_id for entry_id in claimed]
            for entry in await self.streams.read_ids(stream, entry_ids):
                log.warning("reclaiming %s %s (its owner stopped renewing)", stream, entry.entry_id)
                await self.reclaim_handler(entry)

    async def hand_back(self) -> None:
        """Shutdown: make every entry still pending under this consumer immediately claimable
        by other replicas. The server's pending list, not only our bookkeeping: a read whose
        reply arrived as the ingest was being cancelled left entries we never recorded."""
        held = list(self.held.values())
        pending = await self._pending_ids_by_stream()

        async def queue(pipe):
            for stream, ids in pending.items():
                pipe.xclaim(stream, GROUP, self.streams.consumer, 0, ids, idle=HAND_BACK_IDLE_MS, justid=True)
            for delivery in held:
                pipe.hset(self.streams.keys.job(delivery.job_id), "status", "queued")
        await self.streams.write(queue, "hand back")
        log.info("handed back %d unfinished jobs and %d entries not yet taken in", len(held), len(self.intake))
        self.intake.clear()
        self.held.clear()
        self.bytes_held = 0

    async def _pending_ids_by_stream(self) -> dict[str, list[str]]:
        by_stream = self._ids_by_stream()
        for stream in self.streams.request_streams:
            rows = await self.streams.resilient(lambda: self.streams.redis.xpending_range(
                stream, GROUP, min="-", max="+", count=100_000, consumername=self.streams.consumer), "list pending")
            known = set(by_stream.get(stream, []))
            extra = [row["message_id"].decode() for row in rows if row["message_id"].decode() not in known]
            if extra:
                by_stream.setdefault(stream, []).extend(extra)
        return by_stream

    def _ids_by_stream(self) -> dict[str, list[str]]:
        """Every entry this replica holds: running jobs and entries still being taken in."""
        by_stream: dict[str, list[str]] = {}
        entries = {(d.stream, d.entry_id) for d in self.held.values()} | self.intake
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        return by_stream
