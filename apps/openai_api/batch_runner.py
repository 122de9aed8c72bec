"""Runs a batch's lines as queue jobs, from whatever state it is in to a final status.

    validating  -> parse and check every line (custom_id, method, url, body)
                -> failed (errors) or in_progress (total)
    in_progress -> submit at `batch` priority, at most `max_in_flight` jobs at once; each
                   finished job's output line is stored in Redis (batch_store) at once
                -> finalizing -> completed (output and error files assembled)
    cancelling  -> stop submitting, cancel jobs in flight, keep what finished -> cancelled
    past expires_at (24 h): the same wind-down -> expired (the rest: `batch_expired` lines)

Job ids hash the batch id, custom_id and the line's bytes, and submitting a known id is a
no-op, so whoever resumes a batch (another gateway once the lease of a dead one expires,
or `conveyor batch` run again) waits on the jobs already submitted or finished: no job
runs twice and no finished line is redone. `BatchRun` drives one batch while its caller
holds the batch's lease; `BatchRunners` is the loop each gateway runs to find, claim and
drive the unfinished batches of the namespaces it serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from conveyor.apps.openai_api.batch_store import (
    ANY_ENDPOINT,
    BATCH_TTL_S,
    MAX_ERRORS,
    OK,
    TERMINAL,
    BatchStore,
    derived_file_id,
)
from conveyor.apps.openai_api.errors import OpenAIError, from_conveyor
from conveyor.apps.openai_api.json_bounds import MAX_JSON_DEPTH, depth_over
from conveyor.apps.openai_api.work_caps import WorkCaps
from conveyor.clients.async_client import AsyncClient
from conveyor.clients.errors import ConveyorError, InvalidJob, JobCancelled, JobConflict, JobFailed, QueueFull
from conveyor.clients.event_reader import outcome, terminal_from_hash
from conveyor.clients.job_record import FINAL_STATUSES
from conveyor.clients.model_info import fetch_model_info_async
from conveyor.clients.submission import build_job
from conveyor.clients.trace_context import trace_fields_of

log = logging.getLogger("conveyor.batch")

JOB_TERMINAL = FINAL_STATUSES
MAX_CUSTOM_ID_CHARS = 512
FAILED_RETRY_S = 60.0  # a batch whose run raised is left alone this long
STREAM_FIELDS = ("stream", "stream_options")  # a batch answers whole bodies
TOO_DEEP = object()


@dataclass(frozen=True)
class RunnerSettings:
    lease_s: float = 10.0  # how fast a dead runner's batch is taken over
    max_in_flight: int = 64  # jobs of one batch queued or running at once
    poll_s: float = 0.25  # how often jobs in flight and the batch status are looked at
    scan_s: float = 1.0  # how often a gateway looks for unfinished batches
    max_batches: int = 16  # batches one gateway drives at once, but see FairShare: never a tenant's first
    max_batches_per_tenant: int = 2  # batches of one namespace one gateway drives at once
    cancel_wait_s: float = 10.0  # how long a wind-down waits for cancelled jobs to stop
    job_result_ttl: int = 2 * 86_400  # a job's result outlives the 24 h window
    caps: WorkCaps | None = None  # the gateway's --max-samples and --max-total-tokens, per line
    # namespaces with a webhook: a batch's terminal status there queues its batch.* event
    webhook_namespaces: frozenset[str] = frozenset()
    # an OpenTelemetry tracer (the gateway's, where OTEL_* asks for traces): one trace per line
    tracer: Any = None

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)


@dataclass(frozen=True)
class Endpoint:
    """How one URL's request bodies become jobs and results become response bodies."""

    to_job: Callable[[dict], dict]  # body -> AsyncClient.submit keyword arguments (OpenAIError when bad)
    to_body: Callable[..., dict]  # (result, *, request_id, model, created) -> response body
    id_prefix: str = ""  # of the response body's id, before the job id (as the live route answers)
    chat: bool = False  # a chat without max_tokens gets the context its prompt leaves (as live)


def default_endpoints() -> dict[str, Endpoint]:
    from conveyor.apps.openai_api import translate  # the gateway's own mapping: one source of truth

    return {
        "/v1/chat/completions": Endpoint(translate.job_from_chat, translate.chat_body, "chatcmpl-", True),
        "/v1/completions": Endpoint(translate.job_from_completion, translate.completion_body, "cmpl-"),
    }


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------- input lines


@dataclass(frozen=True)
class BatchLine:
    index: int  # position among the file's requests (0-based): the results key
    number: int  # line number in the file (1-based): what errors name
    custom_id: str
    model: str | None
    endpoint: Endpoint
    job: dict[str, Any]  # submit keyword arguments, job_id included

    @property
    def job_id(self) -> str:
        return self.job["job_id"]


class LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def line_job_id(job_key: str, custom_id: str, raw: bytes, model: str | None) -> str:
    digest = hashlib.sha256(b"\0".join([job_key.encode(), custom_id.encode(), raw, (model or "").encode()]))
    return f"batch-{digest.hexdigest()[:40]}"


def parse_input(
    content: bytes,
    batch_id: str,
    endpoint: str,
    endpoints: dict[str, Endpoint],
    model: str | None = None,
    job_result_ttl: int = RunnerSettings.job_result_ttl,
    job_key: str | None = None,
    caps: WorkCaps | None = None,
) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """Every request line checked: (lines, errors in OpenAI's shape, at most MAX_ERRORS).

    `model` replaces every body's model (`conveyor batch`); job ids hash `job_key` (default:
    the batch id), the custom_id, the line and `model`."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = _parse_line(
                raw, number, len(lines), batch_id, endpoint, endpoints, model, job_result_ttl, job_key or batch_id, caps
            )
            if line.custom_id in seen:
                raise LineError(
                    "duplicate_custom_id", f"custom_id {line.custom_id!r} is used more than once", "custom_id"
                )
        except LineError as exc:
            if len(errors) < MAX_ERRORS:
                errors.append({"code": exc.code, "message": exc.message, "param": exc.param, "line": number})
            continue
        seen.add(line.custom_id)
        lines.append(line)
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None})
    return lines, errors


def _parse_line(
    raw: bytes,
    number: int,
    index: int,
    batch_id: str,
    endpoint: str,
    endpoints: dict[str, Endpoint],
    model: str | None,
    job_result_ttl: int,
    job_key: str,
    caps: WorkCaps | None = None,
) -> BatchLine:
    try:
        item = json.loads(raw)
    except ValueError as exc:
        raise LineError("invalid_json_line", f"line {number} is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the parser goes
        item = TOO_DEEP
    if item is TOO_DEEP or depth_over(item, MAX_JSON_DEPTH):
        raise LineError(
            "invalid_json_line", f"line {number} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep"
        )
    if not isinstance(item, dict):
        raise LineError("invalid_json_line", f"line {number} is not a JSON object")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(
            "invalid_custom_id", f"custom_id must be a string of 1..{MAX_CUSTOM_ID_CHARS} characters", "custom_id"
        )
    if item.get("method") != "POST":
        raise LineError("invalid_method", f"method must be POST, got {item.get('method')!r}", "method")
    if url not in endpoints or (endpoint != ANY_ENDPOINT and url != endpoint):
        expected = sorted(endpoints) if endpoint == ANY_ENDPOINT else [endpoint]
        raise LineError(
            "invalid_url", f"url must be {' or '.join(expected)} (the batch's endpoint), got {url!r}", "url"
        )
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", "body")
    body = {k: v for k, v in body.items() if k not in STREAM_FIELDS}
    if model:
        body["model"] = model
    job = _job_of(
        endpoints[url], body, batch_id, custom_id, line_job_id(job_key, custom_id, raw, model), job_result_ttl, caps
    )
    return BatchLine(index, number, custom_id, body.get("model"), endpoints[url], job)


def _job_of(
    endpoint: Endpoint, body: dict, batch_id: str, custom_id: str, job_id: str, ttl: int, caps: WorkCaps | None = None
) -> dict[str, Any]:
    try:
        job = dict(endpoint.to_job(body))
        if caps:
            caps.check(job)
    except OpenAIError as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise LineError(exc.code or "invalid_request", exc.message, param) from None
    if job.get("logprobs") is not None:  # they travel on token events, which a batch does not keep
        raise LineError("unsupported_value", "logprobs are not supported in batch requests", "body.logprobs")
    metadata = {**(job.get("metadata") or {}), "batch_id": batch_id, "custom_id": custom_id}
    job.update(job_id=job_id, priority_class="batch", result_ttl=ttl, metadata=metadata)
    if body.get("seed") is None:  # not translate's random one: a resumed run must submit the same job
        job["seed"] = int(job_id[-15:], 16)
    try:
        build_job(job)  # the protocol's limits, checked now rather than at submit
    except InvalidJob as exc:
        raise LineError("invalid_request", exc.message, f"body.{exc.field}" if exc.field else "body") from None
    return job


# ---------------------------------------------------------------- output lines


def output_line(line: BatchLine, event: Any) -> tuple[dict[str, Any], bool, tuple[int, int]] | None:
    """(OpenAI output line, ok, (prompt, completion) tokens) of a finished job; None: cancelled."""
    try:
        result = outcome(line.job_id, event)
    except JobCancelled:
        return None
    except JobFailed as exc:
        return error_line(line, exc), False, (0, 0)
    body = line.endpoint.to_body(
        result, request_id=line.endpoint.id_prefix + line.job_id, model=line.model, created=int(time.time())
    )
    usage = (result.usage.prompt_tokens, result.usage.completion_tokens)
    return _line(line, {"status_code": 200, "request_id": line.job_id, "body": body}), True, usage


def error_line(line: BatchLine, exc: Exception) -> dict[str, Any]:
    """A request that failed: the status and error body the live endpoint would answer
    (`error` stays null for those, as OpenAI does)."""
    error = from_conveyor(exc)
    return _line(line, {"status_code": error.status, "request_id": line.job_id, "body": error.body()})


def expired_line(line: BatchLine) -> dict[str, Any]:
    message = "This request could not be executed before the completion window expired."
    return {**_line(line, None), "error": {"code": "batch_expired", "message": message}}


def _line(line: BatchLine, response: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{line.job_id[-24:]}", "custom_id": line.custom_id, "response": response, "error": None}


# ---------------------------------------------------------------- one batch


class Lease:
    """The caller's lease on one batch, renewed in the background; `lost` once it is not ours."""

    def __init__(self, store: BatchStore, batch_id: str, owner: str, settings: RunnerSettings) -> None:
        self.store, self.batch_id, self.owner, self.settings = store, batch_id, owner, settings
        self.lost = False
        self._keeper: asyncio.Task | None = None

    async def claim(self) -> bool:
        if not await self.store.claim(self.batch_id, self.owner, self.settings.lease_ms):
            return False
        self._keeper = asyncio.create_task(self._keep())
        return True

    async def _keep(self) -> None:
        while not self.lost:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                self.lost = not await self.store.renew(self.batch_id, self.owner, self.settings.lease_ms)
            except Exception as exc:  # a blip: try again; the lease may outlast it
                log.warning("batch %s: lease renewal failed: %s", self.batch_id, exc)
        log.warning("batch %s: lease lost (another runner took it over)", self.batch_id)

    async def release(self) -> None:
        if self._keeper:
            self._keeper.cancel()
        if not self.lost:
            await self.store.release(self.batch_id, self.owner)


class LeaseLost(Exception):
    pass


class BatchRun:
    """Drives one batch whose lease `lease` holds, to a final status (or until the lease is lost)."""

    def __init__(
        self,
        store: BatchStore,
        client: AsyncClient,
        batch_id: str,
        lease: Lease,
        settings: RunnerSettings = RunnerSettings(),
        endpoints: dict[str, Endpoint] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.store, self.client, self.batch_id, self.lease, self.settings = store, client, batch_id, lease, settings
        self.endpoints = endpoints or default_endpoints()
        self.on_progress = on_progress or (lambda done, total: None)
        self.lines: list[BatchLine] = []
        self.done = 0
        self.submitted = self.reused = 0  # jobs enqueued by this run / found already known
        self._counters: dict[str, tuple[int, Any]] = {}  # model -> (max_model_len, TokenCounter)

    async def run(self) -> str:
        """The status the batch was left in."""
        fields = await self.store.batch_fields(self.batch_id)
        if not fields:
            await self.store.forget_active(self.batch_id)
            return "gone"
        status = fields["status"]
        if status in TERMINAL:
            await self.store.forget_active(self.batch_id)
            return status
        self.lines, errors = await self._parse(fields)
        if status == "validating":
            status = await self._validated(errors)
        elif errors:  # resumed, and the input no longer parses (deleted, or the translation changed)
            status = await self._fail(errors, allowed=("in_progress", "finalizing"))
        if status == "in_progress":
            status = await self._process(float(fields.get("expires_at") or 0))
        if status == "finalizing":
            return await self._assemble("completed", allowed=("finalizing",))
        if status in ("cancelling", "expired"):
            return await self._wind_down("cancelled" if status == "cancelling" else "expired")
        return status

    # ---- validating

    async def _parse(self, fields: dict[str, str]) -> tuple[list[BatchLine], list[dict]]:
        content = await self.store.file_content(fields["input_file_id"])
        if content is None:
            return [], [
                {
                    "code": "file_not_found",
                    "message": f"input file {fields['input_file_id']} not found (expired or deleted)",
                    "param": "input_file_id",
                    "line": None,
                }
            ]
        try:
            return await asyncio.to_thread(
                parse_input,
                content,
                self.batch_id,
                fields["endpoint"],
                self.endpoints,
                fields.get("model_override") or None,
                self.settings.job_result_ttl,
                fields.get("job_key") or None,
                self.settings.caps,
            )
        except Exception as exc:  # a line no check foresaw: the batch fails now, it is not parsed again
            log.warning("batch %s: the input file cannot be parsed: %s", self.batch_id, type(exc).__name__)
            return [], [
                {
                    "code": "invalid_file",
                    "message": f"the input file cannot be parsed ({type(exc).__name__})",
                    "param": "input_file_id",
                    "line": None,
                }
            ]

    async def _validated(self, errors: list[dict]) -> str:
        self._check_lease()
        errors = sorted(errors + await self._unknown_models(), key=lambda e: e["line"] or 0)[:MAX_ERRORS]
        if errors:
            return await self._fail(errors, allowed=("validating",))
        model = next((line.model for line in self.lines if line.model), "")
        _, status = await self.store.transition(
            self.batch_id,
            ("validating",),
            "in_progress",
            total=len(self.lines),
            in_progress_at=int(time.time()),
            model=model,
        )
        return status

    async def _unknown_models(self) -> list[dict]:
        """Lines naming a model this namespace does not publish while it publishes others
        (the live routes' 404; with none published, jobs wait for replicas to come up)."""
        published = await self._published_models()
        if not published:
            return []
        return [
            {
                "code": "model_not_found",
                "message": f"The model `{line.model}` does not exist (served here: {', '.join(sorted(published))})",
                "param": "body.model",
                "line": line.number,
            }
            for line in self.lines
            if line.model and line.model not in published
        ][:MAX_ERRORS]

    async def _published_models(self) -> set[str]:
        names = sorted(n.decode() for n in await self.client.redis.smembers(self.client.keys.models))
        pipe = self.client.redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(self.client.keys.model_info(name))
        return {name for name, alive in zip(names, await pipe.execute()) if alive}

    async def _fail(self, errors: list[dict], allowed: tuple[str, ...]) -> str:
        payload = json.dumps({"object": "list", "data": errors})
        _, status = await self.store.transition(
            self.batch_id, allowed, "failed", errors=payload, failed_at=int(time.time())
        )
        return status

    # ---- in_progress

    async def _process(self, expires_at: float) -> str:
        """Submit and collect until every line has its output; a cancel or the window's end stops it."""
        recorded = await self.store.recorded_indexes(self.batch_id)
        self._progress(len(recorded))
        pending = deque(line for line in self.lines if line.index not in recorded)
        in_flight: dict[str, BatchLine] = {}
        while pending or in_flight:
            status = await self._status(expires_at)
            if status != "in_progress":
                return status
            await self._fill(pending, in_flight)
            await asyncio.sleep(self.settings.poll_s)
            await self._collect(in_flight, pending)
        _, status = await self.store.transition(
            self.batch_id, ("in_progress",), "finalizing", finalizing_at=int(time.time())
        )
        return status

    async def _status(self, expires_at: float) -> str:
        self._check_lease()
        status = (await self.store.batch_fields(self.batch_id)).get("status", "gone")
        if status == "in_progress" and expires_at and time.time() >= expires_at:
            return "expired"
        return status

    async def _fill(self, pending: deque[BatchLine], in_flight: dict[str, BatchLine]) -> None:
        batch = [pending.popleft() for _ in range(min(len(pending), self.settings.max_in_flight - len(in_flight)))]
        jobs = [await self._with_room_left(line) for line in batch]
        spans = self._line_spans(batch)
        if spans:
            jobs = [{**job, **trace_fields_of(span)} for job, span in zip(jobs, spans)]
        replies = await asyncio.gather(*(self.client.submit(**job) for job in jobs), return_exceptions=True)
        for span in spans:
            span.end()
        failed = []
        for line, reply in zip(batch, replies):
            if isinstance(reply, QueueFull):
                pending.appendleft(line)  # the queue is at its bound: try again on a later tick
            elif isinstance(reply, (JobConflict, InvalidJob)):
                failed.append((line, error_line(line, reply)))
            elif isinstance(reply, BaseException):
                raise reply
            else:
                in_flight[line.job_id] = line
                self.submitted += bool(reply.enqueued)
                self.reused += not reply.enqueued
        await self._record([(line, (out, False, (0, 0))) for line, out in failed])

    def _line_spans(self, lines: list[BatchLine]) -> list:
        """One new trace per line (a batch of 50,000 lines is not one trace of 50,000 jobs):
        a producer span each, whose context its job carries to the replica."""
        tracer = self.settings.tracer
        if tracer is None:
            return []
        from opentelemetry import context, trace

        return [
            tracer.start_span(
                "batch line",
                context=context.Context(),
                kind=trace.SpanKind.PRODUCER,
                attributes={
                    "conveyor.batch_id": self.batch_id,
                    "conveyor.custom_id": str(line.custom_id)[:256],
                    "conveyor.job_id": line.job_id,
                    "conveyor.namespace": self.client.keys.ns,
                },
            )
            for line in lines
        ]

    async def _with_room_left(self, line: BatchLine) -> dict[str, Any]:
        """A chat naming no max_tokens gets the context its prompt leaves, as the live route
        gives it (counted with the model's published tokenizer; else the job's default)."""
        if not line.endpoint.chat or "max_tokens" in line.job or not line.model:
            return line.job
        if line.model not in self._counters:
            try:
                info = await fetch_model_info_async(self.client.redis, self.client.keys, line.model)
                self._counters[line.model] = (info.max_model_len, info.token_counter())
            except ConveyorError:  # not published (yet), or no tokenizer: the replica judges
                return line.job
        max_model_len, counter = self._counters[line.model]
        try:
            used = await asyncio.to_thread(counter.checked_count_chat, line.job["messages"])
        except Exception as exc:  # a template that fails or is refused (token_counter's bounds): the job's default
            log.debug("batch %s: cannot count a chat prompt for %s: %s", self.batch_id, line.model, exc)
            return line.job
        share = self.settings.caps.share(line.job) if self.settings.caps else max_model_len
        return {**line.job, "max_tokens": max(1, min(max_model_len - used, share))}

    async def _collect(self, in_flight: dict[str, BatchLine], pending: deque[BatchLine] | None) -> None:
        """Record the jobs of `in_flight` that finished (and forget them); a job gone is resubmitted."""
        states = await self._job_states(list(in_flight.values()))
        finished = []
        for line, (status, event) in zip(list(in_flight.values()), states):
            if status in JOB_TERMINAL:
                finished.append((line, output_line(line, event)))
            elif status in (None, "rejected") and pending is not None:
                pending.appendleft(line)  # its record expired or was refused: submit it again
            else:
                continue
            del in_flight[line.job_id]
        await self._record([(line, out) for line, out in finished if out is not None])

    async def _job_states(self, lines: list[BatchLine]) -> list[tuple[str | None, Any]]:
        pipe = self.client.redis.pipeline(transaction=False)
        for line in lines:
            pipe.hmget(self.client.keys.job(line.job_id), "status", "result")
        states = []
        for status, result in await pipe.execute():
            fields = {b"status": status, b"result": result} if status else {}
            states.append((status.decode() if status else None, terminal_from_hash(fields)))
        return states

    async def _record(self, outputs: list[tuple[BatchLine, tuple]]) -> None:
        if not outputs:
            return
        pipe = self.client.redis.pipeline(transaction=False)
        for line, (out, ok, usage) in outputs:
            await self.store.queue_record(pipe, self.batch_id, line.index, out, ok, usage)
        await pipe.execute()
        self._progress(self.done + len(outputs))

    def _progress(self, done: int) -> None:
        self.done = done
        self.on_progress(done, len(self.lines))

    def _check_lease(self) -> None:
        if self.lease.lost:
            raise LeaseLost(self.batch_id)

    # ---- cancelling, expired, finalizing

    async def _wind_down(self, final: str) -> str:
        """Cancel what runs, keep what finished, then assemble the partial output."""
        recorded = await self.store.recorded_indexes(self.batch_id)
        live = {line.job_id: line for line in self.lines if line.index not in recorded}
        await self._collect(live, None)  # finished ones are kept; `live` keeps the rest
        states = await self._job_states(list(live.values()))
        running = {line.job_id: line for line, (status, _) in zip(list(live.values()), states) if status}
        await self._cancel_jobs(list(running))
        ends = time.monotonic() + self.settings.cancel_wait_s
        while running and time.monotonic() < ends:
            self._check_lease()
            await asyncio.sleep(self.settings.poll_s)
            await self._collect(running, None)
        allowed = ("cancelling",) if final == "cancelled" else ("in_progress",)
        return await self._assemble(final, allowed=allowed)

    async def _cancel_jobs(self, job_ids: list[str]) -> None:
        """Cancel in rounds of the in-flight bound: a batch holds no more Redis commands at once
        than it does jobs in flight."""
        step = max(1, self.settings.max_in_flight)
        for start in range(0, len(job_ids), step):
            await asyncio.gather(*(self.client.job(job_id).cancel() for job_id in job_ids[start : start + step]))

    async def _assemble(self, final: str, allowed: tuple[str, ...]) -> str:
        """Write the output and error files from the stored lines, then set the final status."""
        self._check_lease()
        stored = await self.store.results(self.batch_id, [line.index for line in self.lines])
        outputs, errors = [], []
        for line in self.lines:
            value = stored.get(line.index)
            if value is not None:
                (outputs if value[:1] == OK else errors).append(value[1:])
            elif final == "expired":
                errors.append(json.dumps(expired_line(line), separators=(",", ":")).encode())
        fields = {
            "completed": len(outputs),
            "failed": len(errors),
            f"{final}_at": int(time.time()),
            "output_file_id": await self._write_file("output", outputs),
            "error_file_id": await self._write_file("error", errors),
        }
        changed, status = await self.store.transition(self.batch_id, allowed, final, **fields)
        if changed:
            await self.store.drop_results(self.batch_id)
        return status

    async def _write_file(self, kind: str, lines: list[bytes]) -> str:
        if not lines:
            return ""
        file_id = derived_file_id(self.batch_id, kind)
        await self.store.put_file(
            b"\n".join(lines) + b"\n",
            filename=f"{self.batch_id}_{kind}.jsonl",
            purpose="batch_output",
            file_id=file_id,
            ttl_s=BATCH_TTL_S,
            lines=len(lines),
        )
        return file_id


# ---------------------------------------------------------------- every batch of a gateway


class BatchRunners:
    """A gateway's runner loop: finds unfinished batches in the namespaces it serves, claims
    each with a lease and drives it; a batch whose runner died is taken over once its lease
    expires. Namespaces are added with `watch(client)` (one AsyncClient per tenant)."""

    def __init__(
        self,
        settings: RunnerSettings = RunnerSettings(),
        endpoints: dict[str, Endpoint] | None = None,
        owner: str | None = None,
    ) -> None:
        self.settings, self.owner = settings, owner or new_owner()
        self.endpoints = endpoints
        self._stores: dict[str, tuple[BatchStore, AsyncClient]] = {}
        self._running: dict[tuple[str, str], asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._closing = False
        self._failed_at: dict[tuple[str, str], float] = {}  # batches whose run raised: left alone a while
        self._share = FairShare(settings.max_batches, settings.max_batches_per_tenant)

    def watch(self, client: AsyncClient) -> None:
        if client.keys.ns not in self._stores:
            events = client.keys.webhooks if client.keys.ns in self.settings.webhook_namespaces else None
            self._stores[client.keys.ns] = (BatchStore(client.redis, client.keys.ns, events), client)
            self.wake()

    def wake(self) -> None:
        """Look for work now (a batch was just created), not at the next scan."""
        self._wake.set()

    async def run(self) -> None:
        """Scan every scan_s (or when woken) until close()."""
        while not self._closing:
            try:
                await self.scan()
            except Exception as exc:  # Redis away: the next scan tries again
                log.warning("batch scan failed: %s", exc)
            await self._sleep()

    async def _sleep(self) -> None:
        # asyncio.wait, not wait_for: before 3.12 wait_for may swallow a cancellation
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({woken}, timeout=self.settings.scan_s)
        finally:
            woken.cancel()
        self._wake.clear()

    async def scan(self) -> None:
        now = time.monotonic()
        self._failed_at = {key: t for key, t in self._failed_at.items() if now - t < FAILED_RETRY_S}
        waiting = {ns: await self._waiting(store, ns) for ns, (store, _) in list(self._stores.items())}
        for ns, batch_id, cancelling in self._share.order(waiting):
            if self._closing:
                return
            if cancelling or self._share.may_start(ns, self._running):
                store, client = self._stores[ns]
                await self._try_start(store, client, batch_id)

    async def _waiting(self, store: BatchStore, ns: str) -> list[tuple[str, bool]]:
        """(batch id, cancelling) of the namespace's active batches this gateway does not drive;
        a run that raised is retried after FAILED_RETRY_S, not at every scan."""
        ids = [
            i for i in await store.active_batch_ids() if (ns, i) not in self._running and (ns, i) not in self._failed_at
        ]
        statuses = await store.statuses(ids)
        return [(i, status == "cancelling") for i, status in zip(ids, statuses)]

    async def _try_start(self, store: BatchStore, client: AsyncClient, batch_id: str) -> None:
        lease = Lease(store, batch_id, self.owner, self.settings)
        if await lease.claim():
            if self._closing:  # close() came while claiming
                return await lease.release()
            key = (store.keys.ns, batch_id)
            self._running[key] = asyncio.create_task(self._drive(store, client, lease), name=f"batch {batch_id}")

    async def _drive(self, store: BatchStore, client: AsyncClient, lease: Lease) -> None:
        run = BatchRun(store, client, lease.batch_id, lease, self.settings, self.endpoints)
        try:
            status = await run.run()
            log.info("batch %s: %s (%d jobs submitted, %d reused)", lease.batch_id, status, run.submitted, run.reused)
        except LeaseLost:
            pass
        except Exception:
            log.exception("batch %s: runner failed; retried in %.0f s", lease.batch_id, FAILED_RETRY_S)
            self._failed_at[(store.keys.ns, lease.batch_id)] = time.monotonic()
        finally:
            self._running.pop((store.keys.ns, lease.batch_id), None)
            await _quietly(lease.release())

    async def close(self) -> None:
        """Stop scanning and driving (leases released: another runner resumes at once)."""
        self._closing = True
        self.wake()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)


class FairShare:
    """Which waiting batches a gateway starts, so that no tenant's batches crowd out another's.

    Namespaces take turns (round robin, the first turn rotating from scan to scan); a
    namespace drives at most `per_tenant` batches at once, and the gateway `total`, except
    that a namespace driving none may always start one. A batch being cancelled is started
    whatever the counts (its wind-down is short) and before the others. The bound: a
    tenant's batch, when none of its own runs, is claimed at the first scan after it is
    created (at once on the gateway that accepted it, else within scan_s), however many
    batches other tenants have; its jobs then queue in its own namespace's streams."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self._turn = 0

    def order(self, waiting: dict[str, list[tuple[str, bool]]]) -> list[tuple[str, str, bool]]:
        """(namespace, batch id, cancelling): cancelling ones first, then one of each namespace in turn."""
        names = sorted(waiting)
        self._turn += 1
        names = names[self._turn % len(names) :] + names[: self._turn % len(names)] if names else []
        lists = [[(ns, i, c) for i, c in waiting[ns]] for ns in names]
        interleaved = [item for rank in itertools.zip_longest(*lists) for item in rank if item]
        return sorted(interleaved, key=lambda item: not item[2])  # stable: the turns stay in order

    def may_start(self, ns: str, running: dict[tuple[str, str], Any]) -> bool:
        own = sum(1 for key in running if key[0] == ns)
        return own == 0 or (own < self.per_tenant and len(running) < self.total)


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:
        log.warning("batch lease release failed: %s", exc)
