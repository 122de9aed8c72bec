"""Plain data carried between actors' mailboxes."""
from dataclasses import dataclass, field

from clients.protocol import JobRequest
from engine.outputs import RequestOutput
from engine.sequence import Sequence


@dataclass
class Delivery:
    """One request-stream entry this replica holds the lease of."""
    stream: str
    entry_id: str
    job_id: str
    attempt: int = 1
    result_ttl: int = 86_400
    metadata: dict = field(default_factory=dict)
    deadline: float | None = None  # absolute epoch seconds
    size: int = 0  # bytes of the entry: counted against the replica's bytes in flight
    abort_reason: str | None = None  # why the scheduler aborted it ('cancelled', 'deadline_exceeded', ...)


@dataclass
class NewJob:
    delivery: Delivery
    job: JobRequest
    seq: Sequence


@dataclass
class AbortJob:
    job_id: str
    reason: str  # 'cancelled' | 'deadline_exceeded' | 'shutdown'


@dataclass
class StepOutputs:
    """A step's outputs, paired with the delivery each belongs to."""
    items: list[tuple[Delivery, RequestOutput]]


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
