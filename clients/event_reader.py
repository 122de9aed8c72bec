"""I/O-free logic shared by the sync and async clients for reading a job's out stream."""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from conveyor.clients.errors import JobCancelled, JobFailed, Timeout
from conveyor.clients.events import (
    CancelledEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    OutputChoice,
    TerminalEvent,
    Timings,
    TokenEvent,
    Usage,
    decode_event,
    decode_event_data,
)
from conveyor.clients.job_record import FINAL_STATUSES
from conveyor.clients.job_record import Field as HashField

READ_COUNT = 512
TERMINAL_STATUSES = FINAL_STATUSES
_STATUS, _RESULT, _ATTEMPT, _UPDATED, _CANCEL = (
    name.encode()
    for name in (HashField.STATUS, HashField.RESULT, HashField.ATTEMPT, HashField.UPDATED, HashField.CANCEL)
)


class JobResult(BaseModel):
    """The final output of a successful job (from its `done` event)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt: int = 1
    entry_id: str | None = None
    outputs: list[OutputChoice] = Field(default_factory=list)  # every output, index order (n of them)
    resumed_tokens: int = 0  # output tokens carried over from an earlier attempt (a resumed job)


class JobStatus(BaseModel):
    """Snapshot of the job hash; status is "unknown" when the hash does not exist."""

    job_id: str
    status: str
    attempt: int = 0
    updated: float | None = None
    cancel_requested: bool = False


class EventReader:
    """Turns out-stream entries into the events a caller should see, in order.

    Fences stale owners (events of an older attempt than one already seen are dropped),
    drops duplicate token events (same attempt, seq already seen) and marks the first
    token of a retry with `reset=True`. Given the request `entry_id` the job was written
    as, it also drops refusals of other entries under the same job id (a raw producer's
    XADD may race a refusal left by an earlier, unreadable entry).
    """

    def __init__(self, from_id: str = "0-0", entry_id: str | None = None) -> None:
        self.last_id = from_id
        self.entry_id = entry_id
        self.attempt = 0
        self.next_seq = 0

    def feed(self, entries: list[tuple[Any, dict]]) -> list[Event]:
        accepted = []
        for entry_id, fields in entries:
            self.last_id = _text(entry_id)
            event = self._accept(decode_event(fields, self.last_id))
            if event is not None:
                accepted.append(event)
                if event.is_terminal:
                    break
        return accepted

    def _accept(self, event: Event) -> Event | None:
        if event.attempt < self.attempt:
            return None  # a stale owner's event after a retry started
        if (
            isinstance(event, ErrorEvent)
            and event.rejected_entry
            and self.entry_id
            and event.rejected_entry != self.entry_id
        ):
            return None  # another entry was refused, not ours
        if isinstance(event, TokenEvent):
            return self._accept_token(event)
        return event

    def _accept_token(self, event: TokenEvent) -> TokenEvent | None:
        if event.attempt == self.attempt and event.seq < self.next_seq:
            return None  # duplicate write
        new_attempt = event.attempt > self.attempt
        restarts = event.attempt > 1 and (event.seq == 0 or (new_attempt and self.attempt > 0))
        event.reset = restarts and event.resumed_tokens is None  # a resumed attempt continues
        self.attempt, self.next_seq = event.attempt, event.seq + 1
        return event


def entries_of(reply: Any) -> list[tuple[Any, dict]]:
    """Entries of a single-stream XREAD reply, RESP2 ([[key, entries]]) or RESP3 ({key: ...})."""
    if not reply:
        return []
    if isinstance(reply, dict):
        streams = list(reply.values())
        return [tuple(e) for e in streams[0]] if streams else []
    return [tuple(e) for e in reply[0][1]]


def terminal_from_hash(fields: dict) -> TerminalEvent | None:
    """The terminal event stored in the job hash, if the job has finished."""
    status = _text(fields.get(_STATUS))
    result = fields.get(_RESULT)
    if status not in TERMINAL_STATUSES or not result:
        return None
    return decode_event_data(result, status)


def status_from_hash(job_id: str, fields: dict) -> JobStatus:
    if not fields:
        return JobStatus(job_id=job_id, status="unknown")
    return JobStatus(
        job_id=job_id,
        status=_text(fields.get(_STATUS)) or "unknown",
        attempt=int(_number(fields.get(_ATTEMPT)) or 0),
        updated=_number(fields.get(_UPDATED)),
        cancel_requested=fields.get(_CANCEL) == b"1",
    )


def _number(value) -> float | None:
    """A number the hash should hold (any producer can write the hash: junk reads as None)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and abs(number) < 2**53 else None


def outcome(job_id: str, event: TerminalEvent) -> JobResult:
    """JobResult of a done event; raises JobFailed / JobCancelled for the others."""
    if isinstance(event, ErrorEvent):
        raise JobFailed(event.code, event.message, job_id=job_id, attempt=event.attempt, metadata=event.metadata)
    if isinstance(event, CancelledEvent):
        raise JobCancelled(job_id=job_id, attempt=event.attempt, metadata=event.metadata)
    assert isinstance(event, DoneEvent), event
    fields = event.model_dump(exclude={"type", "seq", "outputs"})
    return JobResult(job_id=job_id, **fields, outputs=event.all_outputs(), entry_id=event.entry_id)


MAX_BLOCK_MS = 2000  # below redis-py's default 5 s socket timeout; callers loop until the deadline


class Deadline:
    """Remaining time of an optional timeout, as XREAD BLOCK milliseconds."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.restart()

    def restart(self) -> None:
        self.ends = None if self.timeout is None else time.monotonic() + self.timeout

    def block_ms(self) -> int:
        if self.ends is None:
            return MAX_BLOCK_MS  # no deadline: wait in slices, forever
        return max(1, min(MAX_BLOCK_MS, int((self.ends - time.monotonic()) * 1000)))

    def expired(self) -> bool:
        return self.ends is not None and time.monotonic() >= self.ends

    def raise_if_expired(self, job_id: str, what: str) -> None:
        if self.expired():
            raise Timeout(f"job {job_id}: no {what} within {self.timeout} s", job_id=job_id)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
