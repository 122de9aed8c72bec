"""Conveyor's light client (the base install: `pip install conveyor`): wire protocol, sync and
async clients, the `submit`, `status` and `dead` commands. Needs only redis, msgpack, pydantic
and tqdm (never torch, transformers, engine/, actors/ or the applications in apps/)."""

from conveyor.clients.async_client import AsyncClient, AsyncJob
from conveyor.clients.client import Client, Job
from conveyor.clients.errors import (
    ConveyorError,
    InvalidJob,
    JobCancelled,
    JobConflict,
    JobFailed,
    ProtocolError,
    QueueFull,
    QuotaExceeded,
    Timeout,
)
from conveyor.clients.event_reader import JobResult, JobStatus
from conveyor.clients.events import CancelledEvent, DoneEvent, ErrorEvent, TokenEvent
from conveyor.clients.keys import GROUP, PRIORITY_CLASSES, Keys
from conveyor.clients.protocol import (
    SCHEMA_VERSION,
    JobRequest,
    decode_event,
    decode_job,
    encode_event,
    encode_job,
)

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "CancelledEvent",
    "Client",
    "ConveyorError",
    "DoneEvent",
    "ErrorEvent",
    "GROUP",
    "InvalidJob",
    "Job",
    "JobCancelled",
    "JobConflict",
    "JobFailed",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "Keys",
    "PRIORITY_CLASSES",
    "ProtocolError",
    "QueueFull",
    "QuotaExceeded",
    "SCHEMA_VERSION",
    "Timeout",
    "TokenEvent",
    "decode_event",
    "decode_job",
    "encode_event",
    "encode_job",
]
