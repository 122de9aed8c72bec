"""I/O-free logic shared by the sync and async clients for submitting and cancelling jobs."""

from __future__ import annotations

import difflib
import time
from typing import Any, Iterable

from conveyor.clients.errors import InvalidJob, JobConflict, QueueFull, QuotaExceeded
from conveyor.clients.keys import Keys
from conveyor.clients.protocol import JobRequest, encode_job, payload_digest, validate_job
from conveyor.clients.trace_context import current_trace_fields
from conveyor.clients.usage import next_day_start

JOB_FIELDS = frozenset(JobRequest.model_fields)
SUBMIT_CHUNK = 500  # jobs per pipelined round trip in submit_many


def build_job(fields: dict[str, Any]) -> JobRequest:
    """Validate submit() keyword arguments; unknown names are an error (likely typos)."""
    unknown = sorted(set(fields) - JOB_FIELDS)
    if unknown:
        raise InvalidJob(_unknown_message(unknown[0]), field=unknown[0])
    given = {k: v for k, v in fields.items() if v is not None}  # None: the default
    if "traceparent" not in given:  # the producer's active span, when it traces (OpenTelemetry)
        given.update(current_trace_fields())
    return validate_job(given)


def build_jobs(items: Iterable[dict[str, Any]]) -> list[JobRequest]:
    """Validate every job before anything is written; errors name the item index."""
    jobs = []
    for index, item in enumerate(items):
        try:
            jobs.append(build_job(dict(item)))
        except InvalidJob as exc:
            raise InvalidJob(f"jobs[{index}]: {exc.message}", field=exc.field, problems=exc.problems) from None
    return jobs


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, JOB_FIELDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{name}: unknown job field{hint}"


def submit_args(keys: Keys, job: JobRequest, max_queue_len: int | None) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of SUBMIT_LUA for `job` (a job naming a model goes to that model's stream)."""
    data = encode_job(job)["data"]
    args = [data, job.result_ttl, repr(time.time()), max_queue_len or 0, payload_digest(job)]
    stream = keys.job_request_stream(job.job_id, job.priority_class, job.model)
    return [keys.job(job.job_id), stream, keys.out(job.job_id), keys.job_limits(job.job_id)], args


# SUBMIT_LUA replies (0: job id already known, not enqueued)
BUDGET_SPENT, OPERATOR_QUEUE_FULL, CONFLICT, QUEUE_FULL, ENQUEUED = -4, -3, -2, -1, 1


def check_submitted(
    code: int, job: JobRequest, keys: Keys, max_queue_len: int | None, submitted: list | None = None
) -> None:
    if code in (QUEUE_FULL, OPERATOR_QUEUE_FULL):
        raise queue_full(job, keys, max_queue_len, submitted or [], operator=code == OPERATOR_QUEUE_FULL)
    if code == BUDGET_SPENT:
        raise budget_spent(job, keys)
    if code == CONFLICT:
        raise JobConflict(f"job_id {job.job_id!r} was already submitted with a different payload", job_id=job.job_id)


def check_chunk(
    codes: list[int], chunk: list[JobRequest], keys: Keys, max_queue_len: int | None, submitted: list
) -> None:
    """submit_many: the first failed job of a pipelined chunk raises (after the rest went in)."""
    for code, job in zip(codes, chunk):
        check_submitted(code, job, keys, max_queue_len, submitted)


def queue_full(
    job: JobRequest, keys: Keys, max_queue_len: int | None, submitted: list, operator: bool = False
) -> QueueFull:
    """QueueFull naming the bound that was hit: the caller's max_queue_len or the operator's."""
    stream = keys.job_request_stream(job.job_id, job.priority_class, job.model)
    if operator:
        message = (
            f"{stream} is full at the server's queue bound (max_queue_len in "
            f"{keys.job_limits(job.job_id)}, "
            f"set by the replicas' operator); try again later"
        )
    else:
        message = f"{stream} holds {max_queue_len} or more entries (the caller's max_queue_len={max_queue_len})"
    return QueueFull(message, submitted=submitted)


def budget_spent(job: JobRequest, keys: Keys) -> QuotaExceeded:
    """QuotaExceeded naming the budget and when it resets (the next midnight UTC)."""
    resets = next_day_start(time.time()).strftime("%Y-%m-%dT%H:%M:%SZ")
    return QuotaExceeded(
        f"namespace {keys.ns!r} has spent its daily token budget (token_budget in "
        f"{keys.job_limits(job.job_id)}, set by the replicas' operator); it resets at {resets}"
    )


def cancel_args(keys: Keys, job_id: str) -> tuple[list[str], list[str]]:
    return [keys.job(job_id)], [keys.cancel, job_id]
