"""JobLedger: the one owner of what this replica holds (entries being taken in, deliveries
whose job runs here, credits and bytes in flight) and of their leases: it renews them,
reclaims entries whose owner stopped renewing (a crashed replica) and hands the rest back
at shutdown. Others send it the messages of actors/messages.py; ingest, on the same event
loop, calls its intake methods instead (``entries_read``, ``may_start``, ``track``,
``entry_done``): they change the ledger's state without awaiting, so a job's entry goes
from read to held in one step, counted once, and ingest never waits on an answer per job.

The lease measures how fast a crash is noticed, never how long a job may run: in-flight
entries are re-claimed by their owner (XCLAIM ... JUSTID resets their idle time) every
third of the lease, however long the job takes.

Its mailbox is unbounded so that no sender ever waits on it (it sends to ingest and the
engine-core actor, whose work flows back here). What queues stays bounded: bookkeeping notices by
the entries in flight, the cancel watcher's requests by its waiting for each answer."""

import asyncio
import logging

from redis.exceptions import ResponseError

from conveyor.actors.base import Actor
from conveyor.actors.config import ReplicaConfig
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
from conveyor.clients.log_limits import RateLimitedLog, shown

log = logging.getLogger(__name__)
RECLAIM_BATCH = 64  # entries taken over per stream per reclaim round


class JobLedger(Actor):
    name = "ledger"
    mailbox_size = 0  # unbounded: see the module's docstring

    def __init__(self, streams: Streams, config: ReplicaConfig, capacity: int):
        super().__init__()
        self.streams = streams
        self.config = config
        self.capacity = capacity
        self.ingest: Actor | None = None  # reclaimed entries go through its mailbox
        self.engine_core: Actor | None = None  # aborts of cancelled jobs go there
        self.held: dict[str, Delivery] = {}  # job id -> delivery
        self.bytes_held = 0  # sum of the held deliveries' entry sizes
        # (stream, entry id) read, not yet taken in (or refused, not yet dead-lettered) -> its bytes
        self.intake: dict[tuple[str, str], int] = {}
        self.bytes_taking_in = 0  # sum of intake's bytes
        self.parked: dict[str, list[ReadEntry]] = {}  # job id held -> its other entries, until released
        self.reserved = (0, 0)  # (credits, bytes) granted to the read ingest is making
        self.credit_request: asyncio.Future | None = None  # ingest's, until it can be granted
        self.cancelled: set[str] = set()  # held jobs whose abort went to the engine-core actor
        self.drains: list[asyncio.Future] = []  # answered once nothing is held
        self.reclaiming = True
        self.partitions = None  # the PartitionKeeper: owned partitions are reclaimed every round
        self.next_reclaim = 0  # ... and one more partition per round, in turn
        self.warnings = RateLimitedLog(log)
        self.handlers = {
            WantCredits: self._want_credits,
            EntryDone: self._entry_done,
            Release: self._release,
            CancelRequest: self._cancel,
            HeldJobs: self._held_jobs,
            Drain: self._drain,
            HandBack: self._hand_back,
        }

    def connect(self, ingest: Actor, engine_core: Actor) -> None:
        """The actors it sends to (they are built after it: both send to the ledger)."""
        self.ingest, self.engine_core = ingest, engine_core

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        renew_at = reclaim_at = loop.time()
        while not self.stopped:
            if loop.time() >= renew_at:
                await self._guarded(self._renew, "renew")
                renew_at = loop.time() + self.config.renew_interval_s
            if self.reclaiming and loop.time() >= reclaim_at and self._free_credits() > 0 and self._free_bytes() > 0:
                await self._guarded(self._reclaim, "reclaim")
                reclaim_at = loop.time() + self.config.reclaim_interval_s
            message = await self._next_message(renew_at - loop.time())
            if message is not None:
                await self.handlers[type(message)](message)
            self._grant_credits()

    async def _next_message(self, timeout: float):
        if not self.mailbox.empty():
            return self.mailbox.get_nowait()
        try:
            return await asyncio.wait_for(self.mailbox.get(), max(0.0, timeout))
        except asyncio.TimeoutError:
            return None

    async def _guarded(self, upkeep, what: str) -> None:
        try:
            await upkeep()
        except ResponseError as exc:  # e.g. a producer replaced a request stream by another type
            self.warnings.warning("leases", "%s failed: %s", what, shown(str(exc), 200))

    # ---- credits ------------------------------------------------------------------------
    def _free_credits(self) -> int:
        parked = sum(len(entries) for entries in self.parked.values())
        return self.capacity - len(self.held) - len(self.intake) - parked - self.reserved[0]

    def _free_bytes(self) -> int:
        return self.config.max_bytes_in_flight - self.bytes_held - self.bytes_taking_in - self.reserved[1]

    def _grant_credits(self) -> None:
        request = self.credit_request
        if request is not None and request.done():  # its asker stopped waiting (shutdown)
            self.credit_request = request = None
        if request is not None and self._free_credits() > 0 and self._free_bytes() > 0:
            self.reserved = (self._free_credits(), self._free_bytes())
            request.set_result(self.reserved)
            self.credit_request = None

    # ---- messages -----------------------------------------------------------------------
    async def _want_credits(self, message: WantCredits) -> None:
        assert self.credit_request is None or self.credit_request.done(), "one read at a time"
        self.credit_request = message.reply

    async def _entry_done(self, message: EntryDone) -> None:
        self.entry_done(message.stream, message.entry_id)

    # ---- ingest's calls: no await in any of them ------------------------------------------
    def entries_read(self, entries: list[ReadEntry]) -> None:
        """Read with the grant: leased, and their bytes counted, from now on."""
        self.reserved = (0, 0)
        for entry in entries:
            self._take_in(entry)

    def may_start(self, job_id: str, entry: ReadEntry) -> bool:
        """False when this replica runs that job already (e.g. requeued while its old attempt
        finishes): starting it now would count a second attempt under the running one. The
        entry is then parked (leased, holding its credit) and goes back to ingest as
        ``Reclaimed`` once the job is released."""
        if job_id not in self.held:
            return True
        self.parked.setdefault(job_id, []).append(entry)
        self._forget_intake(entry.stream, entry.entry_id)
        self._grant_credits()  # its bytes are free now (its credit stays taken)
        return False

    def track(self, delivery: Delivery) -> None:
        """Ingest started this delivery's attempt: held until released; its entry's bytes
        move from intake to held."""
        assert delivery.job_id not in self.held, delivery.job_id  # ingest asked may_start first
        self.held[delivery.job_id] = delivery
        self.bytes_held += delivery.size
        self._forget_intake(delivery.stream, delivery.entry_id)

    def entry_done(self, stream: str, entry_id: str) -> None:
        """Done with an entry that started nothing (dropped, or dead-lettered by the publisher)."""
        self._forget_intake(stream, entry_id)
        self._grant_credits()  # ingest may be waiting for a grant while it takes in reclaimed entries

    def _forget_intake(self, stream: str, entry_id: str) -> None:
        self.bytes_taking_in -= self.intake.pop((stream, entry_id), 0)

    def _take_in(self, entry: ReadEntry) -> None:
        key = (entry.stream, entry.entry_id)
        self.bytes_taking_in += entry.bytes_read - self.intake.get(key, 0)
        self.intake[key] = entry.bytes_read

    # ---- messages from the publisher, the cancel watcher and the replica -------------------
    async def _release(self, message: Release) -> None:
        delivery = message.delivery
        if self.held.get(delivery.job_id) != delivery:
            return  # not ours any more (handed back)
        del self.held[delivery.job_id]
        self.bytes_held -= delivery.size
        self.cancelled.discard(delivery.job_id)
        for entry in self.parked.pop(delivery.job_id, []):
            self._take_in(entry)
            await self.ingest.send(Reclaimed(entry))
        if not self.held:
            for reply in self.drains:
                _answer(reply, None)
            self.drains.clear()

    async def _cancel(self, message: CancelRequest) -> None:
        """Only jobs held here go further, each once: a flood of cancels costs O(1) each."""
        job_id = message.job_id
        if job_id in self.held and job_id not in self.cancelled:
            self.cancelled.add(job_id)
            await self.engine_core.send(AbortJob(job_id, "cancelled", self.held[job_id].door))
        _answer(message.reply, job_id in self.held)

    async def _held_jobs(self, message: HeldJobs) -> None:
        _answer(message.reply, list(self.held))

    async def _drain(self, message: Drain) -> None:
        self.reclaiming = False
        if self.held:
            self.drains.append(message.reply)
        else:
            _answer(message.reply, None)

    # ---- leases -------------------------------------------------------------------------
    async def _renew(self) -> None:
        await self.streams.renew(self._ids_by_stream())

    async def _reclaim(self) -> None:
        """Take over entries idle longer than the lease (their owner died); ingest reruns them."""
        min_idle_ms = int(self.config.lease_s * 1000)
        for stream in self._reclaim_streams():
            count = min(self._free_credits(), RECLAIM_BATCH)
            if count <= 0 or self._free_bytes() <= 0:
                return
            claimed = await self.streams.claim_idle(stream, min_idle_ms, count)
            # ids only: the entries themselves come through the size-bounded read. Our own
            # entries (idle after renewals failed) are already held or being taken in: skipped.
            ours = self._entries()
            for entry in await self.streams.read_ids(stream, [i for i in claimed if (stream, i) not in ours]):
                log.warning("reclaiming %s %s (its owner stopped renewing)", stream, entry.entry_id)
                self._take_in(entry)
                await self.ingest.send(Reclaimed(entry))  # its mailbox is unbounded: never waits

    def _reclaim_streams(self) -> list[str]:
        """The streams of the owned partitions and of one more in turn: a bounded number of
        commands per round whatever the number of partitions (a dead owner's partitions get
        a new owner within a lease, who then reclaims them)."""
        if self.partitions is None:  # no ownership: every replica reclaims every partition
            return list(self.streams.request_streams)
        count = self.streams.keys.partitions
        extra, self.next_reclaim = self.next_reclaim, (self.next_reclaim + 1) % count
        owned = self.partitions.owned if self.partitions is not None else frozenset()
        return [s for p in sorted(owned | {extra}) for s in self.streams.partition_streams(p)]

    async def _hand_back(self, message: HandBack) -> None:
        """Shutdown: every entry still pending under this consumer becomes claimable by other
        replicas at once. The server's pending list, not only our bookkeeping: a read whose
        reply arrived as ingest was being cancelled left entries we never recorded."""
        running = list(self.held.values())
        await self.streams.hand_back(await self._pending_ids_by_stream(), running)
        log.info("handed back %d unfinished jobs and %d entries not yet taken in", len(running), len(self.intake))
        self.intake.clear()
        self.bytes_taking_in = 0
        self.parked.clear()
        self.held.clear()
        self.bytes_held = 0
        _answer(message.reply, None)

    async def _pending_ids_by_stream(self) -> dict[str, list[str]]:
        by_stream = self._ids_by_stream()
        for stream in self.streams.request_streams:
            known = set(by_stream.get(stream, []))
            extra = [entry_id for entry_id in await self.streams.pending_ids(stream) if entry_id not in known]
            if extra:
                by_stream.setdefault(stream, []).extend(extra)
        return by_stream

    def _entries(self) -> set[tuple[str, str]]:
        """Every entry this replica holds: running jobs', those being taken in, and parked ones."""
        parked = {(entry.stream, entry.entry_id) for entries in self.parked.values() for entry in entries}
        return {(d.stream, d.entry_id) for d in self.held.values()} | self.intake.keys() | parked

    def _ids_by_stream(self) -> dict[str, list[str]]:
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in self._entries():
            by_stream.setdefault(stream, []).append(entry_id)
        return by_stream


def _answer(reply: asyncio.Future, value) -> None:
    if not reply.done():  # its asker may have stopped waiting
        reply.set_result(value)
