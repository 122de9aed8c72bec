"""The gateway's ASGI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions on
the queue, plus /health, /metrics (the gateway's own series and the queue's gauges) and the
operator's /dashboard (gateway/dashboard_routes.py). Stateless: each request is one job (submit, then
read its events); any number of gateways may run against one Redis.

Request headers of our own (all optional):
  Authorization: Bearer <key>        when keys are configured (see tenants.py)
  X-Conveyor-Priority-Class          interactive | batch (overrides service_tier; the key caps it)
  X-Conveyor-Keep-On-Disconnect      true: the job runs on when the client goes away
                                     (default: a disconnect cancels the job)
  X-Conveyor-Timeout-S               seconds, below the gateway's --timeout-s: the job's deadline
Every generation response carries `X-Conveyor-Job-Id` (also the tail of the response `id`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.apps.openai_api.batch_store import MAX_UPLOAD_BYTES
from conveyor.apps.openai_api.errors import OpenAIError, from_conveyor, invalid
from conveyor.apps.openai_api.tool_requests import counted_messages, reads_tools
from conveyor.apps.openai_api.translate import (
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    job_from_chat,
    job_from_completion,
    stream_flags,
)
from conveyor.apps.openai_api.work_caps import DEFAULT_MAX_TOKENS, WorkCaps
from conveyor.clients.async_client import AsyncJob
from conveyor.clients.errors import ConveyorError
from conveyor.clients.event_reader import outcome
from conveyor.clients.events import Event, TokenEvent
from conveyor.gateway import dashboard_routes, usage_routes
from conveyor.gateway.adapters import adapter_objects, resolve_model
from conveyor.gateway.allowed_hosts import AllowedHosts, HostPolicy
from conveyor.gateway.body_limit import BodyLimit, read_json
from conveyor.gateway.queue_gauges import QueueCollector
from conveyor.gateway.queue_watch import QueueWatches
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.streaming import BadLogprobs, ChunkWriter, checked_logprobs, sse_events, stream_fault
from conveyor.gateway.tenant_share import TenantShare
from conveyor.gateway.tenants import KeyRing, Namespaces, ServedModel, Tenant, load_grants, tenant_of
from conveyor.gateway.tools import ToolChunkWriter, named_function, with_tool_calls
from conveyor.gateway.tracing import tracing_middleware
from conveyor.gateway.webhook_config import webhook_targets
from conveyor.gateway.webhooks import sender_for

log = logging.getLogger("conveyor.gateway")
DEADLINE_GRACE_S = 2.0  # past a job's deadline, wait this long for the replica to report it
CANCEL_TIMEOUT_S = 5.0
TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def create_app(
    settings: GatewaySettings | None = None, extra_routers: Iterable[APIRouter] = (), api: bool = True
) -> FastAPI:
    """The app; `extra_routers` are mounted next to the core routes (they may use tenant_of).
    `api=False` (`conveyor dashboard`): only /health, /metrics and /dashboard."""
    settings = settings or GatewaySettings()
    app = FastAPI(title="Conveyor gateway", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    grants = load_grants(settings.keys_file, settings.api_keys)
    app.state.keyring = KeyRing(grants)
    served = sorted({g.namespace for g in grants.values()}) if grants else [settings.namespace]
    # namespace -> its webhook target (a bad URL or secret file: ValueError now, at startup)
    app.state.webhooks = webhook_targets(settings, grants, served) if api else {}
    app.state.metrics = Metrics()
    app.add_middleware(BodyLimit, limit_of=_body_limit_of(settings), timeout_s=settings.body_timeout_s)
    app.add_middleware(
        TenantShare,
        tenant_of_key=_namespace_of_key(app.state.keyring, settings),
        limit=settings.max_requests_per_tenant,
    )
    app.add_middleware(AllowedHosts, policy=HostPolicy(settings.allowed_hosts, settings.host))
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    traced = tracing_middleware()  # None unless OTEL_* asks for traces
    if traced is not None:
        app.add_middleware(traced[0], **traced[1])
    _add_error_handlers(app)
    app.include_router(ops_router)
    app.include_router(dashboard_routes.router)
    if api:
        app.include_router(router)
        app.include_router(usage_routes.router)
    for extra in extra_routers:
        app.include_router(extra)
    return app


def _body_limit_of(settings: GatewaySettings) -> Callable[[str], int]:
    def limit_of(path: str) -> int:
        return MAX_UPLOAD_BYTES if path.rstrip("/") == "/v1/files" else settings.max_body_bytes

    return limit_of


def _namespace_of_key(keyring: KeyRing, settings: GatewaySettings) -> Callable[[str | None], str | None]:
    def namespace_of(key: str | None) -> str | None:
        if not keyring.enabled:
            return settings.namespace
        grant = keyring.grant_for(key) if key else None
        return grant.namespace if grant else None

    return namespace_of


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: GatewaySettings = app.state.settings
    redis = settings.redis.async_client(socket_connect_timeout=5)
    app.state.namespaces = Namespaces(redis, settings.replica_idle_s, settings.model_cache_s, settings.redis.partitions)
    app.state.watches = QueueWatches(redis, lambda ns: app.state.namespaces.client(ns).keys)
    log.info(
        "gateway on Redis %s, %s",
        settings.redis.describe(),
        f"{len(app.state.keyring)} API keys"
        if app.state.keyring.enabled
        else f"no API keys: every request uses namespace {settings.namespace!r}",
    )
    sender = sender_for(redis, app.state.webhooks, lambda ns: app.state.namespaces.client(ns).keys)
    sender.start()
    try:
        yield
    finally:
        await sender.stop()
        await redis.aclose()


# ---------------------------------------------------------------- metrics


class Metrics:
    """Prometheus series of one app, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conveyor_gateway_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "conveyor_gateway_request_duration_seconds",
            "Request start to the last byte of the response (streams included)",
            ["route"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "conveyor_gateway_requests_in_flight", "HTTP requests being served", registry=self.registry
        )
        self.queues = QueueCollector()
        self.registry.register(self.queues)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would buffer streams and hide disconnects)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, started = 500, time.perf_counter()

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # the template: bounded labels
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


# ---------------------------------------------------------------- errors


def _add_error_handlers(app: FastAPI) -> None:
    def reply(error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return reply(exc)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        return reply(invalid(str(first.get("msg", "invalid request")), param=".".join(map(str, first.get("loc", ())))))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return reply(OpenAIError(exc.status_code, str(exc.detail), code=None))

    async def redis_error(request: Request, exc: RedisError) -> JSONResponse:
        log.warning("Redis error on %s: %s", request.url.path, type(exc).__name__)
        return reply(OpenAIError(503, "the queue (Redis) is unavailable, try again later", code="queue_unavailable"))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return reply(OpenAIError(500, "internal error", code="internal_error"))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RedisError, redis_error)
    app.add_exception_handler(Exception, unexpected)


# ---------------------------------------------------------------- routes

ops_router = APIRouter()
router = APIRouter()


@ops_router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while Redis answers (the gateway's only dependency), else 503."""
    try:
        await request.app.state.namespaces.redis.ping()
    except RedisError:
        return JSONResponse({"status": "unavailable", "redis": "unreachable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@ops_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The gateway's series and the queue's gauges of every configured namespace, read now
    (or under a second ago: one read per namespace however many scrape)."""
    state = request.app.state
    namespaces = state.keyring.namespaces() if state.keyring.enabled else [state.settings.namespace]
    facts = [await state.watches.of(ns).latest() for ns in namespaces]
    state.metrics.queues.update(facts)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(tenant: Tenant = Depends(tenant_of)) -> dict:
    """Models with a live replica in the tenant's namespace (ModelDirectory says how)."""
    live = await tenant.models.live()
    return {"object": "list", "data": [_model_object(m) for m in live] + adapter_objects(live)}


@router.get("/v1/models/{model_id}")
async def retrieve_model(model_id: str, tenant: Tenant = Depends(tenant_of)) -> dict:
    return _model_object(await tenant.models.require(model_id))


def _model_object(model: ServedModel) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "created": int(model.published_at),
        "owned_by": "conveyor",
        "max_model_len": model.max_model_len,
    }


@router.post("/v1/completions")
async def completions(request: Request, tenant: Tenant = Depends(tenant_of)) -> Response:
    return await generate(request, tenant, COMPLETIONS)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, tenant: Tenant = Depends(tenant_of)) -> Response:
    return await generate(request, tenant, CHAT)


# ---------------------------------------------------------------- one generation request


@dataclass(frozen=True)
class Endpoint:
    chat: bool
    id_prefix: str
    job_from: Callable[[dict], dict]


COMPLETIONS = Endpoint(False, "cmpl-", job_from_completion)
CHAT = Endpoint(True, "chatcmpl-", job_from_chat)


@dataclass(frozen=True)
class RequestOptions:
    """What the request's own headers ask for (module docstring)."""

    priority_class: str | None
    keep_on_disconnect: bool
    timeout_s: float

    @classmethod
    def of(cls, request: Request, settings: GatewaySettings) -> RequestOptions:
        headers = request.headers
        keep = headers.get("x-conveyor-keep-on-disconnect", "").strip().lower()
        if keep not in TRUE + FALSE:
            raise invalid("X-Conveyor-Keep-On-Disconnect must be true or false", param="X-Conveyor-Keep-On-Disconnect")
        priority_class = headers.get("x-conveyor-priority-class")
        return cls(
            priority_class and priority_class.strip().lower(),
            keep in TRUE,
            _timeout(headers.get("x-conveyor-timeout-s"), settings.timeout_s),
        )


def _timeout(header: str | None, limit: float) -> float:
    if header is None:
        return limit
    try:
        seconds = float(header)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise invalid("X-Conveyor-Timeout-S must be a number of seconds > 0", param="X-Conveyor-Timeout-S")
    return min(seconds, limit)


class JobRun:
    """One request's job: cancelled when the request stops before the job ended, unless
    the request asked to keep it."""

    def __init__(self, job: AsyncJob, keep: bool) -> None:
        self.job = job
        self.keep = keep
        self.ended = False

    async def end(self) -> None:
        self.ended = True

    async def abandon(self) -> None:
        if self.ended or self.keep:
            return
        self.ended = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_TIMEOUT_S):  # even while being cancelled
            try:
                await self.job.cancel()
            except RedisError as exc:
                log.warning("could not cancel job %s: %s", self.job.job_id, type(exc).__name__)


class ClientDisconnected(Exception):
    pass


@dataclass
class Plan:
    """A validated generation request: the job's fields and how to answer."""

    fields: dict
    options: RequestOptions
    stream: bool
    include_usage: bool
    vocab: Any  # the model's TokenCounter when logprobs were asked for


async def generate(request: Request, tenant: Tenant, endpoint: Endpoint) -> Response:
    settings: GatewaySettings = request.app.state.settings
    plan = await _plan(request, tenant, endpoint, settings)
    job = await _submit(tenant, plan.fields, settings, time.time() + plan.options.timeout_s)
    run = JobRun(job, plan.options.keep_on_disconnect)
    writer = ChunkWriter(
        endpoint.chat,
        endpoint.id_prefix + job.job_id,
        plan.fields["model"],
        int(time.time()),
        plan.include_usage,
        plan.vocab,
        plan.fields.get("n", 1),
    )
    if endpoint.chat and reads_tools(plan.fields):
        writer = ToolChunkWriter(**vars(writer), job_id=job.job_id, named=named_function(plan.fields))
    events = job.events(timeout=plan.options.timeout_s + DEADLINE_GRACE_S, idle=False)
    try:
        if plan.stream:
            return await _streamed(request, run, events, writer)
        terminal, logprobs = await _unless_disconnected(request, _collect(events, plan.vocab is not None))
        await run.end()
        body = _response_body(endpoint, outcome(job.job_id, terminal), writer, logprobs, plan.fields)
        return JSONResponse(body, headers={"X-Conveyor-Job-Id": job.job_id})
    except ClientDisconnected:
        await run.abandon()
        return Response(status_code=499)  # nobody reads it; it shows in the metrics and the access log
    except (ConveyorError, BadLogprobs) as exc:  # the job failed, its deadline passed (Timeout), bad logprobs
        await run.abandon()
        raise stream_fault(exc) if isinstance(exc, BadLogprobs) else from_conveyor(exc) from None
    except BaseException:
        await run.abandon()
        raise


async def _plan(request: Request, tenant: Tenant, endpoint: Endpoint, settings: GatewaySettings) -> Plan:
    body = await read_json(request, settings.max_body_bytes)
    fields = endpoint.job_from(body)
    stream, include_usage = stream_flags(body)
    options = RequestOptions.of(request, settings)
    fields["priority_class"] = tenant.priority_for(options.priority_class or fields.get("priority_class"))
    model = await resolve_model(tenant, fields)  # an adapter's name: its base model, and `lora`
    vocab = await _vocabulary(tenant, model) if "logprobs" in fields else None
    caps = WorkCaps(settings.max_samples, settings.max_total_tokens)
    caps.check(fields, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
    if endpoint.chat and "max_tokens" not in fields:
        left = await tenant.models.context_left(model.name, counted_messages(fields))
        fields["max_tokens"] = min(left or DEFAULT_MAX_TOKENS, caps.share(fields))
    return Plan(fields, options, stream, include_usage, vocab)


async def _streamed(request: Request, run: JobRun, events: AsyncIterator[Event], writer: ChunkWriter) -> Response:
    """Waits for the job's first event: a job that fails before its first token gets a
    plain HTTP error (400, 504...) instead of a stream that holds only an error."""
    first = await _unless_disconnected(request, anext(events))
    if first.is_terminal:
        await run.end()
        outcome(run.job.job_id, first)  # raises for error and cancelled
    headers = {"X-Conveyor-Job-Id": run.job.job_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # the background task runs after the stream ends or the client left, even when the
    # body never started (the generator's own cleanup then never runs): no job left behind
    return StreamingResponse(
        sse_events(first, events, writer, run.end, run.abandon),
        media_type="text/event-stream",
        headers=headers,
        background=BackgroundTask(run.abandon),
    )


def _response_body(
    endpoint: Endpoint, result: Any, writer: ChunkWriter, logprobs: dict[int, list[dict]], fields: dict
) -> dict:
    common = dict(request_id=writer.request_id, model=writer.model, created=writer.created)
    indices = [output.index for output in result.outputs]
    if endpoint.chat:
        tier = "flex" if fields["priority_class"] == "batch" else "default"
        rendered = {i: chat_logprobs(logprobs.get(i, []), writer.vocab) for i in indices} if writer.vocab else None
        body = chat_body(result, **common, logprobs=rendered, service_tier=tier)
        return with_tool_calls(body, result.outputs) if reads_tools(fields) else body
    rendered = {i: completion_logprobs(logprobs.get(i, []), writer.vocab) for i in indices} if writer.vocab else None
    return completion_body(result, **common, logprobs=rendered)


async def _collect(events: AsyncIterator[Event], want_logprobs: bool) -> tuple[Event, dict[int, list[dict]]]:
    """The terminal event, and the logprob entries of the attempt that reached it, by output index."""
    logprobs: dict[int, list[dict]] = {}
    async for event in events:
        if not isinstance(event, TokenEvent):
            return event, logprobs
        if event.reset:
            logprobs = {}
        elif event.resumed_tokens is not None:  # a resumed attempt continues the output its readers hold
            logprobs = {index: kept[: event.resumed_tokens] for index, kept in logprobs.items()}
        logprobs.setdefault(event.index, []).extend(checked_logprobs(event) if want_logprobs else [])
    raise AssertionError("events() ended without a terminal event")


async def _unless_disconnected(request: Request, work: Awaitable) -> Any:
    """`work`'s result, or ClientDisconnected as soon as the client closes the connection."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone):
            pending.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _submit(tenant: Tenant, fields: dict, settings: GatewaySettings, deadline: float) -> AsyncJob:
    try:
        return await tenant.client.submit(
            **fields, deadline=deadline, result_ttl=settings.result_ttl, max_queue_len=settings.max_queue_len or None
        )
    except ConveyorError as exc:  # InvalidJob, QueueFull, JobConflict
        raise from_conveyor(exc) from None


async def _vocabulary(tenant: Tenant, model: ServedModel) -> Any:
    try:
        return await tenant.models.token_counter(model)
    except ConveyorError:
        raise invalid(
            f"logprobs are not available for model `{model.name}` (no tokenizer published)", param="logprobs"
        ) from None
