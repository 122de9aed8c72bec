"""OpenAI's Responses API over the queue: each response is one chat job.

    POST   /v1/responses               create: plain, streamed (typed events), or background
    GET    /v1/responses/{id}          a stored response (a background one: its state now)
    POST   /v1/responses/{id}/cancel   a background response: its job cancelled
    DELETE /v1/responses/{id}          forget a stored response

Mounted with `create_app(settings, extra_routers=(responses.router,))` (`conveyor gateway`
does). `store` (default true) keeps the response and its conversation in Redis for the
gateway's --result-ttl (response_store.py), so `previous_response_id` continues it; each
tenant's stored responses hold at most --max-stored-bytes (429 past it), and a background
response whose job failed or was cancelled keeps no input. The work caps of chat completions
(--max-samples, --max-total-tokens and the default share) apply.
`background: true` submits a batch-priority job (no deadline: it runs when the queue has
room) and answers at once with status `queued`; GET polls it. In a namespace with a webhook
(docs/webhooks.md) the gateway also notices its end without a GET (settler_lifespan) and
queues its response.* event once. What a body may hold, and how it becomes the job:
response_items.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError
from starlette.background import BackgroundTask

from conveyor.apps.openai_api.errors import OpenAIError, from_conveyor, invalid
from conveyor.apps.openai_api.tool_requests import counted_messages, reads_tools
from conveyor.apps.openai_api.translate import job_from_chat
from conveyor.apps.openai_api.work_caps import DEFAULT_MAX_TOKENS, WorkCaps
from conveyor.clients.async_client import AsyncJob
from conveyor.clients.errors import ConveyorError, JobCancelled, JobFailed
from conveyor.clients.event_reader import JobResult, outcome
from conveyor.clients.events import TokenEvent
from conveyor.clients.job_record import FINAL_STATUSES
from conveyor.gateway.adapters import resolve_model
from conveyor.gateway.app import DEADLINE_GRACE_S, JobRun, RequestOptions, read_json
from conveyor.gateway.response_items import (
    chat_body,
    check_fields,
    history_of,
    input_messages,
    message_item,
    output_items,
    usage,
)
from conveyor.gateway.response_settler import ResponseSettlers
from conveyor.gateway.response_store import ResponseStore, StoreFull
from conveyor.gateway.streaming import Relay, StreamDiverged
from conveyor.gateway.tenants import INTERACTIVE, Tenant, tenant_of


@asynccontextmanager
async def settler_lifespan(app: Any) -> AsyncIterator[None]:
    """For the namespaces with a webhook: their background responses settled every second
    (response_settler.py), so each one's response.* event is queued without a GET."""
    webhooks = getattr(app.state, "webhooks", None) or {}
    namespaces = getattr(app.state, "namespaces", None)  # the core app's lifespan, entered first
    settlers = ResponseSettlers(sorted(webhooks) if namespaces else [], partial(_settle_namespace, app))
    settlers.start()
    try:
        yield
    finally:
        await settlers.stop()


router = APIRouter(lifespan=settler_lifespan)
log = logging.getLogger("conveyor.gateway")
CANCEL_WAIT_S = 5.0  # a cancel waits this long for the job to end before answering
RESULT_READ_S = 5.0
SETTLE_BATCH, SETTLE_EVERY_S = 32, 1.0  # pending background responses one full tenant settles
SETTLE_SCAN = 256  # pending background responses whose job a settler round looks at
_settled_at: dict[str, float] = {}  # namespace -> when it last settled (monotonic)


@router.post("/v1/responses")
async def create_response(request: Request, tenant: Tenant = Depends(tenant_of)) -> Any:
    settings = request.app.state.settings
    body = await read_json(request, settings.max_body_bytes)
    draft = await _draft(request, tenant, body)
    deadline = None if draft.background else time.time() + draft.options.timeout_s
    job_id = uuid.uuid4().hex
    draft.response_id = "resp_" + job_id
    if draft.stored:  # admitted before the job runs: 429 when the tenant's stored bytes are full
        await _admit(draft, tenant, job_id)
    try:
        job = await _submit(tenant, {**draft.fields, "job_id": job_id}, settings, deadline)
    except BaseException:
        await draft.forget()
        raise
    if draft.background:
        await draft.store.save(draft.object("queued"), draft.conversation, job.job_id)
        return draft.object("queued")
    run = JobRun(job, draft.options.keep_on_disconnect)
    events = job.events(timeout=draft.options.timeout_s + DEADLINE_GRACE_S, idle=False)
    if body.get("stream"):
        return StreamingResponse(
            _stream(draft, run, events),
            media_type="text/event-stream",
            headers={"X-Conveyor-Job-Id": job.job_id, "Cache-Control": "no-cache"},
            background=BackgroundTask(run.abandon),
        )
    try:
        terminal = await _terminal(events)
        await run.end()
        return await draft.finish(outcome(job.job_id, terminal))
    except ConveyorError as exc:
        await run.abandon()
        await draft.forget()
        raise from_conveyor(exc) from None
    except BaseException:
        await run.abandon()
        raise


async def _admit(draft: Draft, tenant: Tenant, job_id: str) -> None:
    """Reserve the new record's bytes; when the tenant is full, settle its pending background
    responses first (a failed one's input is dropped, an expired one forgotten), once a second."""
    try:
        await draft.store.reserve(draft.object("queued"), draft.conversation, job_id)
    except StoreFull as full:
        if full.status == 413 or not await _settle(draft.store, tenant):
            raise
        await draft.store.reserve(draft.object("queued"), draft.conversation, job_id)


async def _settle(store: ResponseStore, tenant: Tenant) -> bool:
    """Up to SETTLE_BATCH pending background responses brought up to their job's state; whether
    any changed. At most once per SETTLE_EVERY_S per namespace: refusals cost little."""
    now = time.monotonic()
    if now - _settled_at.get(store.namespace, float("-inf")) < SETTLE_EVERY_S:
        return False
    _settled_at[store.namespace] = now
    changed = False
    for response_id in await store.pending(SETTLE_BATCH):
        record = await store.load(response_id)
        if record is None:  # deleted or expired meanwhile
            await store.release(response_id)
            changed = True
        elif (await _refreshed(store, tenant, record))["response"]["status"] not in ("queued", "in_progress"):
            changed = True
    return changed


async def _settle_namespace(app: Any, namespace: str) -> int:
    settings = app.state.settings
    tenant = Tenant(namespace, INTERACTIVE, app.state.namespaces)
    store = ResponseStore(
        tenant.client.redis, namespace, settings.result_ttl, settings.max_stored_bytes, tenant.client.keys.webhooks
    )
    return await settle_finished(store, tenant)


async def settle_finished(store: ResponseStore, tenant: Tenant) -> int:
    """Of the oldest SETTLE_SCAN pending background responses, up to SETTLE_BATCH whose job has
    ended brought up to date (saved final: with a webhook, their event queued); how many.
    A response's job id is its id without `resp_` (create_response); the job hashes' statuses
    are read in one round trip, and only the final ones loaded."""
    ids = await store.pending(SETTLE_SCAN)
    pipe = tenant.client.redis.pipeline(transaction=False)
    for response_id in ids:
        pipe.hget(tenant.client.keys.job(response_id.removeprefix("resp_")), "status")
    statuses = await pipe.execute(raise_on_error=False) if ids else []
    ended = [i for i, status in zip(ids, statuses) if isinstance(status, bytes) and status.decode() in FINAL_STATUSES]
    for response_id in ended[:SETTLE_BATCH]:
        record = await store.load(response_id)
        try:
            if record is None:  # deleted or expired meanwhile
                await store.release(response_id)
            else:
                await _refreshed(store, tenant, record)
        except (ConveyorError, RedisError) as exc:  # one unreadable result holds up no other response
            log.warning("background response %s of %s not settled: %s", response_id[:80], tenant.namespace, exc)
    return len(ended[:SETTLE_BATCH])


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, tenant: Tenant = Depends(tenant_of)) -> dict:
    store = _store(request, tenant)
    return (await _refreshed(store, tenant, await _record(store, response_id)))["response"]


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request, tenant: Tenant = Depends(tenant_of)) -> dict:
    store = _store(request, tenant)
    record = await _record(store, response_id)
    if not record["response"].get("background"):
        raise invalid("only a background response can be cancelled", param="response_id")
    job = tenant.client.job(record["job_id"])
    await job.cancel()
    ends = time.monotonic() + CANCEL_WAIT_S
    while (await job.status()).status not in FINAL_STATUSES and time.monotonic() < ends:
        await asyncio.sleep(0.1)
    return (await _refreshed(store, tenant, record))["response"]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, tenant: Tenant = Depends(tenant_of)) -> dict:
    if not await _store(request, tenant).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---------------------------------------------------------------- one response


@dataclass
class Draft:
    """A validated Responses request: its job's fields, and how to answer and store it."""

    body: dict
    fields: dict
    conversation: list[dict]  # the history a next response continues (no instructions)
    options: RequestOptions
    store: ResponseStore
    created: int
    response_id: str = ""

    @property
    def background(self) -> bool:
        return self.body.get("background") is True

    @property
    def stored(self) -> bool:
        """Whether a record of it is kept (background responses always are)."""
        return self.background or bool(self.body.get("store", True))

    async def forget(self) -> None:
        """Its job failed before any record was written: the reservation is freed."""
        if self.stored:
            await self.store.release(self.response_id)

    @property
    def reads_tools(self) -> bool:
        return reads_tools(self.fields)

    def object(
        self, status: str, output: list[dict] | None = None, result: JobResult | None = None, error: dict | None = None
    ) -> dict:
        body = self.body
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.fields["model"],
            "output": output or [],
            "usage": usage(result),
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "background": self.background,
            "store": body.get("store", True),
            "max_output_tokens": body.get("max_output_tokens"),
            "truncation": "disabled",
        }

    async def finish(self, result: JobResult) -> dict:
        """The completed (or incomplete) response, stored when asked."""
        return await finished(self.store, self.object("in_progress"), self.conversation, result)


async def finished(store: ResponseStore, response: dict, conversation: list[dict], result: JobResult) -> dict:
    output = output_items(result, response["id"])
    status = "incomplete" if result.outputs[0].finish_reason == "length" else "completed"
    final = {**response, "status": status, "output": output, "usage": usage(result)}
    if response.get("store", True) or response.get("background") is True:  # background ones always are
        await store.save(final, history_of(conversation, output), result.job_id)
    return final


async def _draft(request: Request, tenant: Tenant, body: dict) -> Draft:
    settings = request.app.state.settings
    check_fields(body)
    if body.get("background") and body.get("stream"):
        raise invalid("a background response is polled (GET), not streamed", param="stream", code="unsupported_value")
    store = _store(request, tenant)
    history = await _history(store, tenant, body.get("previous_response_id"))
    conversation = history + input_messages(body.get("input"))
    fields = job_from_chat(chat_body(body, conversation))
    options = RequestOptions.of(request, settings)
    wanted = "batch" if body.get("background") else options.priority_class or fields.get("priority_class")
    fields["priority_class"] = tenant.priority_for(wanted)
    model = await resolve_model(tenant, fields)
    caps = WorkCaps(settings.max_samples, settings.max_total_tokens)  # as chat completions'
    caps.check(fields, "max_output_tokens")
    if "max_tokens" not in fields:
        left = await tenant.models.context_left(model.name, counted_messages(fields))
        fields["max_tokens"] = min(left or DEFAULT_MAX_TOKENS, caps.share(fields))
    return Draft(body, fields, conversation, options, store, int(time.time()))


async def _history(store: ResponseStore, tenant: Tenant, previous: Any) -> list[dict]:
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise invalid("previous_response_id must be a string", param="previous_response_id")
    record = await _refreshed(store, tenant, await _record(store, previous, "previous_response_id"))
    if record["response"]["status"] not in ("completed", "incomplete"):
        raise invalid(
            f"previous response {previous!r} is {record['response']['status']}, not completed",
            param="previous_response_id",
        )
    return record["messages"]


async def _record(store: ResponseStore, response_id: str, param: str = "response_id") -> dict:
    record = await store.load(response_id)
    if record is None:
        raise _not_found(response_id, param)
    return record


async def _refreshed(store: ResponseStore, tenant: Tenant, record: dict) -> dict:
    """A background response's record brought up to its job's state (stored once final)."""
    response = record["response"]
    if response["status"] not in ("queued", "in_progress"):
        return record
    job = tenant.client.job(record["job_id"])
    status = (await job.status()).status
    if status not in FINAL_STATUSES:
        return {**record, "response": {**response, "status": "in_progress" if status == "running" else "queued"}}
    try:
        final = await finished(store, response, record["messages"], await job.result(timeout=RESULT_READ_S))
    except JobCancelled:
        final = {**response, "status": "cancelled"}
    except JobFailed as exc:
        final = {**response, "status": "failed", "error": {"code": exc.code, "message": exc.reason}}
    if final["status"] in ("cancelled", "failed"):  # never continued: its input is not kept
        await store.save(final, [], record["job_id"])
    return await store.load(response["id"]) or {**record, "response": final}


def _store(request: Request, tenant: Tenant) -> ResponseStore:
    """The tenant's stored responses; with a webhook for its namespace, a background response's
    first final save queues its response.* event."""
    settings = request.app.state.settings
    webhooks = getattr(request.app.state, "webhooks", None) or {}
    events = tenant.client.keys.webhooks if tenant.namespace in webhooks else None
    return ResponseStore(tenant.client.redis, tenant.namespace, settings.result_ttl, settings.max_stored_bytes, events)


def _not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(404, f"No response found with id {response_id[:80]!r}", param=param, code="not_found")


async def _submit(tenant: Tenant, fields: dict, settings: Any, deadline: float | None) -> AsyncJob:
    try:
        return await tenant.client.submit(
            **fields, deadline=deadline, result_ttl=settings.result_ttl, max_queue_len=settings.max_queue_len or None
        )
    except ConveyorError as exc:
        raise from_conveyor(exc) from None


async def _terminal(events: AsyncIterator) -> Any:
    async for event in events:
        if not isinstance(event, TokenEvent):
            return event
    raise AssertionError("events() ended without a terminal event")


# ---------------------------------------------------------------- streaming


class EventWriter:
    """Typed server-sent events, numbered as OpenAI numbers them (`sequence_number`)."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(draft: Draft, run: JobRun, events: AsyncIterator) -> AsyncIterator[str]:
    """response.created, in_progress, the output's text deltas as they come (a chat with
    tools: its items at the end, see tools.py), then the items' done events and completed."""
    send, relay, opened = EventWriter(), Relay(), False
    yield send("response.created", response=draft.object("in_progress"))
    yield send("response.in_progress", response=draft.object("in_progress"))
    try:
        async for event in events:
            if not isinstance(event, TokenEvent):
                result = outcome(run.job.job_id, event)  # raises for error and cancelled
                rest, _ = relay.finish(result.text, result.token_ids)
                final = await draft.finish(result)
                await run.end()
                for line in _closing(send, draft, final, rest, opened):
                    yield line
                return
            delta, _ = relay.feed(event)
            if event.index or draft.reads_tools or not delta:
                continue
            if not opened:
                opened = True
                for line in _open_message(send, draft.response_id):
                    yield line
            yield send(
                "response.output_text.delta",
                item_id=_msg_id(draft),
                output_index=0,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
    except (ConveyorError, StreamDiverged, RedisError) as exc:
        if not isinstance(exc, RedisError):
            await draft.forget()
        error = from_conveyor(exc) if isinstance(exc, ConveyorError) else OpenAIError(500, str(exc))
        yield send(
            "response.failed",
            response=draft.object("failed", error={"code": error.code or "server_error", "message": error.message}),
        )
    finally:
        await run.abandon()  # a no-op once the job ended


def _msg_id(draft: Draft) -> str:
    return message_item(draft.response_id, None)["id"]


def _open_message(send: EventWriter, response_id: str) -> list[str]:
    item = message_item(response_id, None, status="in_progress")
    return [
        send("response.output_item.added", output_index=0, item=item),
        send(
            "response.content_part.added",
            item_id=item["id"],
            output_index=0,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": []},
        ),
    ]


def _closing(send: EventWriter, draft: Draft, final: dict, rest: str, opened: bool) -> list[str]:
    lines = []
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"] if item["content"] else ""
            was_open = opened and index == 0 and not draft.reads_tools
            lines += [] if was_open else _open_message(send, draft.response_id)
            pending = rest if was_open else text
            if pending:
                lines.append(
                    send(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        delta=pending,
                        logprobs=[],
                    )
                )
            part = {"type": "output_text", "text": text, "annotations": []}
            lines += [
                send(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            ]
        else:
            lines += _function_call_events(send, index, item)
        lines.append(send("response.output_item.done", output_index=index, item=item))
    ending = "response.completed" if final["status"] == "completed" else "response.incomplete"
    return lines + [send(ending, response=final)]


def _function_call_events(send: EventWriter, index: int, item: dict) -> list[str]:
    opening = {**item, "status": "in_progress", "arguments": ""}
    return [
        send("response.output_item.added", output_index=index, item=opening),
        send("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]),
        send(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
            name=item["name"],
        ),
    ]
