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
    """A job that ended outside a step (cancelled, failed validation...): publish + ack."""
    delivery: Delivery
    event_type: str  # 'error' | 'cancelled'
    code: str = ""
    message: str = ""
    dead_letter_reason: str | None = None
    raw_fields: dict | None = None
