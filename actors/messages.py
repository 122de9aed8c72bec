"""Plain data carried between actors' mailboxes. A message that asks for an answer carries
a ``reply`` future (``Actor.ask`` sends it and awaits the answer)."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

from conveyor.clients.protocol import JobRequest
from conveyor.clients.tool_parsers import ToolReading
from conveyor.engine.core_request import EngineCoreRequest
from conveyor.engine.outputs import RequestOutput


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(frozen=True)
class Delivery:
    """One request-stream entry this replica holds the lease of (a value: nobody changes it)."""

    stream: str
    entry_id: str
    job_id: str
    attempt: int = 1
    result_ttl: int = 86_400
    metadata: dict = field(default_factory=dict, compare=False)  # the job's, read only
    deadline: float | None = None  # absolute epoch seconds
    size: int = 0  # bytes of the entry: counted against the replica's bytes in flight
    tools: ToolReading | None = field(default=None, compare=False)  # a job with tools: how its outputs are read
    door: str = ""  # the namespace it came through, on a replica serving several ("": the only one)
    webhook: bool = False  # the job asked for job.completed / job.failed webhook events
    spans: Any = field(default=None, compare=False)  # its attempt's open span (actors/tracing.py), when traced
    # a resumed attempt (actors/resume.py): (output tokens, characters of their text) carried over
    resumed: tuple[int, int] | None = field(default=None, compare=False)

    @property
    def request_key(self) -> str:
        """Its request id in the engine: unique across the replica's namespaces."""
        return request_key(self.door, self.job_id)


@dataclass(frozen=True)
class ReadEntry:
    """One request-stream entry as read: ``fields`` is a stub when ``truncated``."""

    stream: str
    entry_id: str
    size: int
    truncated: bool
    fields: dict = field(compare=False)

    @property
    def bytes_read(self) -> int:
        """Bytes this replica holds for it: the whole entry, or only the stub of a truncated one."""
        if not self.truncated:
            return self.size
        return sum(len(key) + len(value) for key, value in self.fields.items())


# ---- to the engine-core actor ------------------------------------------------------
@dataclass
class NewJob:
    delivery: Delivery
    job: JobRequest
    request: EngineCoreRequest


@dataclass
class AbortJob:
    job_id: str
    reason: str  # 'cancelled' | 'deadline_exceeded' | 'shutdown'
    door: str = ""  # the namespace it came through (Delivery.door)

    @property
    def request_key(self) -> str:
        return request_key(self.door, self.job_id)


def request_key(door: str, job_id: str) -> str:
    """A job's request id in the engine: its id, after its namespace on a replica serving
    several (neither holds a '/': no two pairs give one key)."""
    return f"{door}/{job_id}" if door else job_id


# ---- to the publisher -----------------------------------------------------------------
@dataclass
class StepOutputs:
    """A step's outputs: each with its delivery and, for a job the engine-core actor aborted, why."""

    items: list[tuple[Delivery, RequestOutput, str | None]]


@dataclass
class JobEnded:
    """A job that ended outside a step (cancelled, deadline, max deliveries...): publish + ack.
    The entry owns the job (its attempt was started), so its outcome is this job's."""

    delivery: Delivery
    event_type: str  # 'error' | 'cancelled'
    code: str = ""
    message: str = ""
    dead_letter_reason: str | None = None
    raw_fields: dict | None = None  # kept whole in the dead letter (a valid job worth requeueing)


@dataclass
class EntryRefused:
    """An entry that owns no job (unreadable, invalid, or a conflicting second submission):
    dead-lettered (payload capped) and acked; its producer is told why only where no record
    of ``job_id`` exists, so no other job's outcome can change."""

    stream: str
    entry_id: str
    job_id: str | None
    code: str
    message: str
    fields: dict
    size: int = 0
    stub: bool = False  # ``fields`` is the read script's stub of an oversized entry
    notify: bool = True  # False: the id is someone else's (a conflict): dead letter only


# ---- to ingest (from the ledger) ------------------------------------------------------
@dataclass
class Reclaimed:
    """An entry taken over from a replica that stopped renewing; its credit is reserved."""

    entry: ReadEntry


# ---- to the ledger ------------------------------------------------------------------------
@dataclass
class WantCredits:
    """Ingest: answered with (entries, bytes) it may read, once both are above zero. They
    stay reserved until ingest calls ``JobLedger.entries_read``."""

    reply: asyncio.Future = field(default_factory=_future)


@dataclass
class EntryDone:
    """The publisher has dead-lettered a refused entry: its bytes no longer count here."""

    stream: str
    entry_id: str


@dataclass
class Release:
    """The publisher stored this delivery's final outcome and acked its entry."""

    delivery: Delivery


@dataclass
class CancelRequest:
    """The cancel watcher: answered True when the job is held and its abort went to the engine-core actor."""

    job_id: str
    reply: asyncio.Future = field(default_factory=_future)


@dataclass
class HeldJobs:
    """Answered with the ids of the jobs held now (whose cancel flags to poll)."""

    reply: asyncio.Future = field(default_factory=_future)


@dataclass
class Drain:
    """Shutdown: reclaim nothing more; answered once no job is held."""

    reply: asyncio.Future = field(default_factory=_future)


@dataclass
class HandBack:
    """Shutdown: make every entry still pending here claimable by other replicas at once."""

    reply: asyncio.Future = field(default_factory=_future)
