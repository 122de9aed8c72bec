"""The Batch API routes (OpenAI's): files and batches, per tenant namespace.

    POST /v1/files                 multipart: file (JSONL), purpose=batch
    GET  /v1/files                 order (desc: newest first, default; asc), limit (1..10000,
                                   default 10000), after, purpose
    GET  /v1/files/{id}            the file object
    GET  /v1/files/{id}/content    the bytes
    DELETE /v1/files/{id}          409 while a batch that has not finished reads it
    POST /v1/batches               input_file_id, endpoint, completion_window=24h, metadata
    GET  /v1/batches/{id}          the batch object
    GET  /v1/batches               newest first; limit (1..100, default 20), after
    POST /v1/batches/{id}/cancel   -> cancelling, then cancelled with the partial output

Mounted with `create_app(settings, extra_routers=(batch_routes.router,))`. The router's
lifespan starts the gateway's runner loop (batch_runner.BatchRunners), which drives the
unfinished batches of every namespace the gateway serves (its API keys', else its
--namespace), so a batch outlives the gateway that accepted it. Runner options
come from the environment: CONVEYOR_BATCH_LEASE_S, _MAX_IN_FLIGHT, _POLL_S, _SCAN_S,
_MAX_BATCHES, _MAX_BATCHES_PER_TENANT, _CANCEL_WAIT_S (see RunnerSettings for the defaults;
batch_runner.FairShare for how tenants share a gateway's runners).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Callable

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from conveyor.apps.openai_api.batch_runner import BatchRunners, RunnerSettings
from conveyor.apps.openai_api.batch_store import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    MAX_FILE_BYTES,
    MAX_UPLOAD_BYTES,
    BatchStore,
    FileInUse,
    FileTooLarge,
    check_jsonl,
    check_metadata,
)
from conveyor.apps.openai_api.errors import OpenAIError, invalid
from conveyor.apps.openai_api.work_caps import WorkCaps
from conveyor.gateway.body_limit import read_json
from conveyor.gateway.tenants import load_grants, tenant_of
from conveyor.gateway.tracing import gateway_tracer

MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20
MAX_FILES_LIMIT = 10_000  # OpenAI's bound and default for files.list
ORDERS = ("asc", "desc")
STOP_WAIT_S = 5.0  # shutdown: how long the runner loop gets to see it is closed
ENV_SETTINGS = {
    "lease_s": float,
    "max_in_flight": int,
    "poll_s": float,
    "scan_s": float,
    "max_batches": int,
    "max_batches_per_tenant": int,
    "cancel_wait_s": float,
}


def settings_from_env(env: dict[str, str] | None = None) -> RunnerSettings:
    env = os.environ if env is None else env
    values = {
        name: kind(env[f"CONVEYOR_BATCH_{name.upper()}"])
        for name, kind in ENV_SETTINGS.items()
        if env.get(f"CONVEYOR_BATCH_{name.upper()}")
    }
    return RunnerSettings(**values)


@asynccontextmanager
async def runner_lifespan(app: FastAPI):
    """Start this gateway's batch runner loop; stop it (leases released) on shutdown."""
    settings = getattr(app.state, "batch_settings", None) or settings_from_env()
    gateway = getattr(app.state, "settings", None)
    if gateway is not None and settings.caps is None:  # each line as capped as a live request
        settings = replace(settings, caps=WorkCaps(gateway.max_samples, gateway.max_total_tokens))
    webhooks = frozenset(getattr(app.state, "webhooks", None) or ())
    if webhooks:  # their batches' terminal statuses queue batch.* events (gateway/webhooks.py)
        settings = replace(settings, webhook_namespaces=settings.webhook_namespaces | webhooks)
    if settings.tracer is None:  # one trace per batch line, where OTEL_* asks for traces
        settings = replace(settings, tracer=gateway_tracer())
    runners = BatchRunners(settings)
    namespaces = getattr(app.state, "namespaces", None)  # the core app's lifespan, entered first
    for namespace in configured_namespaces(app) if namespaces else ():
        runners.watch(namespaces.client(namespace))
    app.state.batch_runners = runners
    task = asyncio.create_task(runners.run(), name="batch runners")
    try:
        yield
    finally:
        await runners.close()
        done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
        if not done:
            task.cancel()


def configured_namespaces(app: FastAPI) -> list[str]:
    """Every namespace this gateway serves: those of its API keys, else its --namespace."""
    settings, keyring = app.state.settings, app.state.keyring
    if not keyring.enabled:
        return [settings.namespace]
    return sorted({grant.namespace for grant in load_grants(settings.keys_file, settings.api_keys).values()})


def tenant_client(tenant: Any) -> Any:
    """The AsyncClient of a tenant (tenants.Tenant.client)."""
    return tenant.client


def make_router(tenant_dependency: Callable) -> APIRouter:
    """The routes, with `tenant_dependency` resolving each request's tenant."""
    router = APIRouter(lifespan=runner_lifespan)

    def store_of(request: Request, tenant: Any = Depends(tenant_dependency)) -> BatchStore:
        client = tenant_client(tenant)
        runners = getattr(request.app.state, "batch_runners", None)
        if runners is not None:
            runners.watch(client)  # this gateway now also drives (and resumes) that tenant's batches
        return BatchStore(client.redis, client.keys.ns)

    @router.post("/v1/files")
    async def upload_file(request: Request, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        content, filename, purpose = await _read_upload(request)
        try:
            lines = await asyncio.to_thread(check_jsonl, content)  # 64 MB: not on the event loop
        except FileTooLarge as exc:
            raise OpenAIError(413, str(exc), param="file", code="file_too_large") from None
        except ValueError:
            raise invalid("file must be UTF-8 JSONL text", "file") from None
        return await store.put_file(content, filename=filename, purpose=purpose, lines=lines)

    @router.get("/v1/files")
    async def list_files(
        limit: int = MAX_FILES_LIMIT,
        after: str | None = None,
        order: str = "desc",
        purpose: str | None = None,
        store: BatchStore = Depends(store_of),
    ) -> dict[str, Any]:
        if not 1 <= limit <= MAX_FILES_LIMIT:
            raise invalid(f"limit must be 1..{MAX_FILES_LIMIT}, got {limit}", "limit")
        if order not in ORDERS:
            raise invalid(f"order must be asc or desc, got {order[:32]!r}", "order")
        files, has_more = await store.list_files(limit, after, order, purpose)
        return {
            "object": "list",
            "data": files,
            "first_id": files[0]["id"] if files else None,
            "last_id": files[-1]["id"] if files else None,
            "has_more": has_more,
        }

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        try:
            deleted = await store.delete_file(file_id)
        except FileInUse as exc:
            raise OpenAIError(409, str(exc), param="file_id", code="file_in_use") from None
        _found(deleted or None, "File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        return _found(await store.get_file(file_id), "File", file_id)

    @router.get("/v1/files/{file_id}/content")
    async def get_file_content(file_id: str, store: BatchStore = Depends(store_of)) -> Response:
        content = _found(await store.file_content(file_id), "File", file_id)
        return Response(content, media_type="application/octet-stream")

    @router.post("/v1/batches")
    async def create_batch(request: Request, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        body = await _json_object(request)  # bounded in bytes and depth: a 400 or 413, never a 500
        input_file_id = await _input_file(store, body.get("input_file_id"))
        batch, _ = await store.create_batch(
            input_file_id=input_file_id,
            endpoint=_endpoint(body.get("endpoint")),
            completion_window=_window(body.get("completion_window")),
            metadata=_metadata(body.get("metadata")),
        )
        runners = getattr(request.app.state, "batch_runners", None)
        if runners is not None:
            runners.wake()
        return batch

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        return _found(await store.get_batch(batch_id), "Batch", batch_id)

    @router.get("/v1/batches")
    async def list_batches(
        limit: int = DEFAULT_LIST_LIMIT, after: str | None = None, store: BatchStore = Depends(store_of)
    ) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid(f"limit must be 1..{MAX_LIST_LIMIT}, got {limit}", "limit")
        batches, has_more = await store.list_batches(limit, after)
        return {
            "object": "list",
            "data": batches,
            "first_id": batches[0]["id"] if batches else None,
            "last_id": batches[-1]["id"] if batches else None,
            "has_more": has_more,
        }

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, store: BatchStore = Depends(store_of)) -> dict[str, Any]:
        _found(await store.get_batch(batch_id), "Batch", batch_id)
        changed, status = await store.request_cancel(batch_id)
        if not changed and status not in ("cancelling", "cancelled"):  # asking twice is fine
            raise OpenAIError(409, f"Cannot cancel a batch with status {status!r}", code="batch_not_cancellable")
        return await store.get_batch(batch_id)

    return router


# ---------------------------------------------------------------- request parts


async def _read_upload(request: Request) -> tuple[bytes, str, str]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise OpenAIError(413, f"file is over the limit of {MAX_FILE_BYTES} bytes", param="file", code="file_too_large")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except OpenAIError:  # the body limit's 413 or timeout's 408 (body_limit.BodyLimit counts as it arrives)
        raise
    except Exception as exc:  # not multipart, or over the form's limits
        raise invalid(f"expected a multipart form with `file` and `purpose`: {exc}", "file") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch":
        raise invalid(f"purpose must be 'batch', got {purpose!r}", "purpose")
    if upload is None or isinstance(upload, str):
        raise invalid("file is required (a JSONL upload)", "file")
    content = await upload.read(MAX_FILE_BYTES + 1)
    await form.close()
    if len(content) > MAX_FILE_BYTES:
        raise OpenAIError(413, f"file is over the limit of {MAX_FILE_BYTES} bytes", param="file", code="file_too_large")
    return content, (upload.filename or "upload.jsonl")[:256], purpose


async def _json_object(request: Request) -> dict[str, Any]:
    return await read_json(request, request.app.state.settings.max_body_bytes)


async def _input_file(store: BatchStore, file_id: Any) -> str:
    if not isinstance(file_id, str):
        raise invalid("input_file_id is required", "input_file_id", code="missing_required_parameter")
    found = await store.get_file(file_id)
    if found is None:
        raise invalid(f"No such File object: {file_id}", "input_file_id", code="invalid_input_file")
    if found["purpose"] != "batch":
        raise invalid(f"file {file_id} has purpose {found['purpose']!r}, not 'batch'", "input_file_id")
    return file_id


def _endpoint(value: Any) -> str:
    if value not in ENDPOINTS:
        raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {value!r}", "endpoint")
    return value


def _window(value: Any) -> str:
    if value not in COMPLETION_WINDOWS:
        raise invalid(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got {value!r}", "completion_window"
        )
    return value


def _metadata(value: Any) -> dict[str, str]:
    try:
        return check_metadata(value)
    except ValueError as exc:
        raise invalid(str(exc), "metadata") from None


def _found(value: Any, kind: str, object_id: str) -> Any:
    if value is None:
        raise OpenAIError(404, f"No such {kind} object: {object_id}", param="id", code=None)
    return value


router = make_router(tenant_of)
