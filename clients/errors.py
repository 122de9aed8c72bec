"""Typed errors of the Conveyor client and wire protocol (no pydantic types leak out)."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base of every error raised by clients/ code."""

    code = "conveyor_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class ProtocolError(ConveyorError):
    """A stream entry or event that cannot be decoded or is not a valid job.

    `job_id` is filled in when it could still be read from the broken payload, so a
    replica can deliver an error event to that job.
    """

    code = "bad_encoding"

    def __init__(self, message: str, *, code: str | None = None, job_id: str | None = None) -> None:
        super().__init__(message, code=code)
        self.job_id = job_id


class InvalidJob(ProtocolError):
    """A job that decodes but breaks a rule; `field` names the first offending field."""

    code = "invalid_job"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        problems: list[tuple[str, str]] | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(message, job_id=job_id)
        self.field = field
        self.problems = problems or []


class JobFailed(ConveyorError):
    """The job ended with an error event (or, as the subclass JobCancelled, was cancelled)."""

    code = "job_failed"

    def __init__(
        self,
        code: str,
        message: str,
        *,
        job_id: str | None = None,
        attempt: int | None = None,
        metadata: dict | None = None,
    ) -> None:
        super().__init__(f"job {job_id} failed [{code}]: {message}", code=code)
        self.job_id = job_id
        self.reason = message
        self.attempt = attempt
        self.metadata = metadata or {}


class JobCancelled(JobFailed):
    """The job ended with a cancelled event."""

    def __init__(self, *, job_id: str | None = None, attempt: int | None = None, metadata: dict | None = None) -> None:
        super().__init__("cancelled", "job was cancelled", job_id=job_id, attempt=attempt, metadata=metadata)
        self.message = f"job {job_id} was cancelled"


class Timeout(ConveyorError, TimeoutError):
    """No terminal event (result) or no next event (stream) within the timeout."""

    code = "timeout"

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class QuotaExceeded(ConveyorError):
    """The namespace's daily token budget (the replicas' operator sets it) is spent: submits
    are refused until it resets."""

    code = "insufficient_quota"


class QueueFull(ConveyorError):
    """submit(max_queue_len=N) found N or more entries on the request stream.

    `submitted` holds the jobs a submit_many call enqueued before the bound was hit.
    """

    code = "queue_full"

    def __init__(self, message: str, *, submitted: list | None = None) -> None:
        super().__init__(message)
        self.submitted = submitted or []


class JobConflict(ConveyorError):
    """The job_id was already submitted with a different payload (idempotency key reuse)."""

    code = "conflict"

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
