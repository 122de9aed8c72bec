"""IngestActor: pulls only as many jobs as the replica has credits for (a flood waits in
Redis, not in memory), decodes and validates them, and hands them to the scheduler."""
import asyncio
import logging
import time

from actors.base import Actor
from actors.leases import Leases
from actors.messages import Delivery, JobEnded, NewJob
from actors.streams import CONFLICT, DUPLICATE, Streams
from clients.errors import ProtocolError
from clients.keys import GROUP
from clients.protocol import JobRequest, decode_job, payload_digest
from engine import InvalidRequest, LLMEngine, SamplingParams

log = logging.getLogger(__name__)


class IngestActor(Actor):
    name = "ingest"

    def __init__(self, streams: Streams, engine: LLMEngine, leases: Leases, scheduler: Actor,
                 publisher: Actor, max_deliveries: int, read_block_ms: int):
        super().__init__()
        self.streams = streams
        self.engine = engine  # used only for make_sequence (stateless tokenize + validate)
        self.leases = leases
        self.scheduler = scheduler
        self.publisher = publisher
        self.max_deliveries = max_deliveries
        self.read_block_ms = read_block_ms

    async def run(self) -> None:
        while not self.stopped:
            credits = self.leases.free_credits()
            if credits <= 0:
                self.leases.credit_freed.clear()
                await self.leases.credit_freed.wait()
                continue
            entries = await self.streams.read_new(credits, self.read_block_ms)
            # leased from the moment they are read: renewed, never reclaimed from under us
            self.leases.intake.update((stream, entry_id) for stream, entry_id, _ in entries)
            for stream, entry_id, fields in entries:
                await self.accept(stream, entry_id, fields)
                self.leases.intake.discard((stream, entry_id))

    async def accept(self, stream: str, entry_id: str, fields: dict) -> None:
        """One delivered entry (new, or reclaimed from a dead replica)."""
        try:
            job = decode_job(fields, entry_id)
        except ProtocolError as exc:
            delivery = Delivery(stream, entry_id, exc.job_id)
            await self.publisher.send(JobEnded(delivery, "error", exc.code or "invalid_job", exc.message,
                                               dead_letter_reason=f"{exc.code}: {exc.message}", raw_fields=fields))
            return
        if self.leases.holds(job.job_id):  # our own entry, reclaimed after renewals failed: keep running it
            return
        attempt, cancelled = await self.streams.start_attempt(job.job_id, entry_id, job.result_ttl,
                                                              payload_digest(job))
        if attempt in (DUPLICATE, CONFLICT):
            await self._drop_second_submission(stream, entry_id, job, fields, attempt == CONFLICT)
            return
        delivery = Delivery(stream, entry_id, job.job_id, attempt, job.result_ttl, job.metadata, job.deadline)
        self.leases.track(delivery)
        ended = self._reject_reason(job, attempt, cancelled)
        if ended is not None:
            await self.publisher.send(JobEnded(delivery, *ended[:3], dead_letter_reason=ended[3], raw_fields=fields))
            return
        try:
            seq = await asyncio.to_thread(self._make_sequence, job, entry_id)
        except InvalidRequest as exc:
            await self.publisher.send(JobEnded(delivery, "error", "invalid_request", str(exc)))
            return
        await self.scheduler.send(NewJob(delivery, job, seq))

    async def _drop_second_submission(self, stream, entry_id, job, fields, conflict: bool) -> None:
        """Another entry for a job that already has one: the job's own stream is left alone."""
        if conflict:
            reason = f"job_id {job.job_id!r} reused with a different payload"
            await self.publisher.send(JobEnded(Delivery(stream, entry_id, None), "error",
                                               dead_letter_reason=f"conflict: {reason}", raw_fields=fields))
        else:
            await self.streams.resilient(lambda: self.streams.redis.xack(stream, GROUP, entry_id), "ack duplicate")
            await self.streams.resilient(lambda: self.streams.redis.xdel(stream, entry_id), "delete duplicate")

    def _reject_reason(self, job: JobRequest, attempt: int, cancelled: bool):
        """(event type, code, message, dead-letter reason) for a job that must not run."""
        if attempt > self.max_deliveries:
            reason = f"delivered {attempt} times (max_deliveries={self.max_deliveries})"
            return ("error", "max_deliveries", reason, reason)
        if cancelled:
            return ("cancelled", "", "", None)
        if job.deadline is not None and job.deadline <= time.time():
            return ("error", "deadline_exceeded", "the job's deadline passed before it started", None)
        return None

    def _make_sequence(self, job: JobRequest, entry_id: str):
        return self.engine.make_sequence(job.job_id, job.prompt or job.prompt_token_ids,
                                         SamplingParams(**job.sampling_params()), job.priority_class,
                                         job.priority, _enqueue_time(entry_id), job.chat_messages())


def _enqueue_time(entry_id: str) -> float:
    """Stream ids start with the server's milliseconds: queue time counts from XADD."""
    try:
        return int(entry_id.split("-")[0]) / 1000
    except ValueError:
        return time.time()
