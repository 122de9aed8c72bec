"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a status."""

from __future__ import annotations

import re
from typing import Any

from conveyor.clients.errors import InvalidJob, JobConflict, JobFailed, QueueFull, QuotaExceeded, Timeout

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """An error a request gets back; ``param`` names the offending field."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# Status of a job that ended with an error event (by its code, docs/protocol.md "Error codes").
# Unknown codes are the server's problem (500), as the protocol says to treat them as permanent.
JOB_ERROR_STATUS = {
    "invalid_request": 400,
    "invalid_job": 400,
    "bad_encoding": 400,
    "too_large": 400,
    "unsupported_version": 400,
    "deadline_exceeded": 504,
    "insufficient_quota": 429,  # queued past the namespace's daily token budget
    "cancelled": 409,
    "conflict": 409,
}
FIELD_PREFIX = re.compile(r"^(?:invalid job: )?([A-Za-z_][\w.\[\]]*): ")


def from_conveyor(exc: Exception, params: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error for a failure of the queue client or of the job itself.

    `params` renames job fields to the request field the caller used (prompt_token_ids ->
    prompt, max_tokens -> max_completion_tokens...)."""
    params = params or {}
    if isinstance(exc, InvalidJob):
        return invalid(exc.message, param=params.get(exc.field, exc.field), code=exc.code)
    if isinstance(exc, QuotaExceeded):  # OpenAI's shape for a spent quota
        return OpenAIError(429, exc.message, code="insufficient_quota", type="insufficient_quota")
    if isinstance(exc, QueueFull):
        return OpenAIError(429, f"the queue is full, try again later: {exc.message}", code="queue_full")
    if isinstance(exc, JobConflict):
        return OpenAIError(409, exc.message, code="conflict")
    if isinstance(exc, Timeout):
        return OpenAIError(504, "the request's deadline passed before the job finished", code="deadline_exceeded")
    if isinstance(exc, JobFailed):
        return OpenAIError(JOB_ERROR_STATUS.get(exc.code, 500), exc.reason, param=_param_of(exc, params), code=exc.code)
    return OpenAIError(500, "internal error", code="internal_error")


def _param_of(exc: JobFailed, params: dict[str, str]) -> str | None:
    """The field an invalid_request names first ("max_tokens: 4000 is over ...")."""
    if JOB_ERROR_STATUS.get(exc.code) != 400:
        return None
    match = FIELD_PREFIX.match(exc.reason)
    return params.get(match.group(1), match.group(1)) if match else None
