"""The operator's dashboard: `/dashboard` (one static page, its script and style, all served
here: no CDN, no build step) and the JSON it polls under `/dashboard/api/`.

Every value in a reply is producer input (Redis holds what any writer of the namespace put
there): each string is cut to MAX_TEXT characters here, and the page writes values with
textContent only, under a Content-Security-Policy that allows no inline script."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from conveyor.apps.openai_api.batch_store import BatchStore
from conveyor.apps.openai_api.errors import OpenAIError, invalid
from conveyor.clients.dead_letters import dead_page_args, dead_page_from, requeue_async
from conveyor.clients.job_lookup import lookup_args, lookup_from, valid_job_id
from conveyor.clients.queue_metrics import NamespaceFacts
from conveyor.clients.usage import read_usage_async
from conveyor.gateway import dashboard_jobs
from conveyor.gateway.body_limit import read_json
from conveyor.gateway.dashboard_access import Viewer, actor_of, viewer_of
from conveyor.gateway.dashboard_replies import HEADERS, MAX_TEXT, bounded, reply  # noqa: F401  (re-exported)

DEAD_PAGE, MAX_DEAD_PAGE = 25, 100
MAX_REQUEUE_IDS = 100
BATCHES_SHOWN = 20
DEAD_ID = re.compile(r"\d{1,20}-\d{1,20}")
STATIC = Path(__file__).with_name("static")
PAGES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
router = APIRouter(prefix="/dashboard")
router.include_router(dashboard_jobs.router)  # the job page and the lists of jobs


def _static(name: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=PAGES[name], headers=HEADERS)


@router.get("")
@router.get("/")
async def page() -> Response:
    return _static("index.html")


@router.get("/dashboard.js")
async def script() -> Response:
    return _static("dashboard.js")


@router.get("/dashboard.css")
async def style() -> Response:
    return _static("dashboard.css")


@router.get("/api/overview")
async def overview(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    watch = request.app.state.watches.of(viewer.namespace)
    facts = await watch.latest()
    rates = watch.done_per_s()
    queues = [
        {
            "model": s.model,
            "priority_class": s.priority_class,
            "partition": s.partition,
            "queued": s.lag,
            "in_flight": s.pending,
            "oldest_age_s": round(s.oldest_age_s, 1),
            "consumers": s.consumers,
            "done_per_s": round(rates.get((s.model, s.priority_class, s.partition), 0.0), 2),
        }
        for s in facts.streams
        if s.seen
    ]
    return reply(
        {
            "namespace": viewer.namespace,
            "namespaces": list(viewer.namespaces),
            "may_act": viewer.may_act,
            "server_time": facts.server_time,
            "totals": {
                "queued": sum(s.lag for s in facts.streams),
                "in_flight": sum(s.pending for s in facts.streams),
                **taken_apart(facts),
                "dead_letters": facts.dead_letters,
                "replicas_live": sum(r.live(facts.server_time) for r in facts.replicas),
            },
            "queues": queues,
            "tenants_today": await _tenants_today(request, viewer),
            "replicas": [r.view(facts.server_time) for r in facts.replicas],
            "throughput": watch.series(),
        }
    )


def taken_apart(facts: NamespaceFacts) -> dict[str, int]:
    """The jobs replicas took (the `engines` groups' pending entries) as running (the live
    replicas' own count of running sequences, at most all of them) and waiting (the rest:
    read, not yet scheduled, or finished a moment ago and not yet acknowledged), so that
    queued + waiting + running is every job on the request streams."""
    pending = sum(s.pending for s in facts.streams)
    reported = sum(max(r.number("running") or 0.0, 0.0) for r in facts.replicas if r.live(facts.server_time))
    running = min(pending, int(reported))
    return {"waiting": pending - running, "running": running}


async def _tenants_today(request: Request, viewer: Viewer) -> list[dict[str, Any]]:
    """Today's (UTC) billable usage of each namespace the viewer may see, per model
    (clients/usage.py): an admin sees every configured tenant, a tenant itself."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    rows = []
    for namespace in viewer.namespaces:
        client = request.app.state.namespaces.client(namespace)
        found, _ = await read_usage_async(client.redis, client.keys, today, today)
        rows += [{"namespace": namespace, **row.as_dict()} for row in found]
    return rows


@router.get("/api/dead")
async def dead_letters(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    """Newest first; `before`: the last id of the page before (to page on)."""
    before = request.query_params.get("before") or None
    if before is not None and not DEAD_ID.fullmatch(before):
        raise invalid("before must be a dead-letter id", param="before")
    count = _count(request.query_params.get("count"))
    client = request.app.state.namespaces.client(viewer.namespace)
    redis, keys = client.redis, client.keys
    page = dead_page_from(keys, await redis.eval(*dead_page_args(keys, before, count)))
    total = await redis.xlen(keys.dead)
    letters = [
        {
            "dead_id": s.letter.dead_id,
            "at": s.letter.at,
            "job_id": s.letter.job_id or "",
            "raw_job_id": "" if s.letter.job_id else s.raw_job_id,  # not a valid id: shown as written
            "stream": s.letter.stream,
            "reason": s.letter.reason,
            "payload_kept": s.payload_kept,
            "requeueable": s.refused is None,
            "why_not": s.refused[1] if s.refused else "",
        }
        for s in page
    ]
    return reply({"letters": letters, "total": total, "next": page[-1].letter.dead_id if len(page) == count else None})


def _count(text: str | None) -> int:
    try:
        count = int(text) if text else DEAD_PAGE
    except ValueError:
        raise invalid("count must be an integer", param="count") from None
    return max(1, min(count, MAX_DEAD_PAGE))


@router.post("/api/dead/requeue")
async def requeue_dead(request: Request, viewer: Viewer = Depends(actor_of)) -> JSONResponse:
    """{"ids": [dead-letter ids]} or {"all": true}: `conveyor dead requeue`'s rules."""
    body = await read_json(request, 64 * 1024)
    ids = body.get("ids") if isinstance(body, dict) else None
    every = isinstance(body, dict) and body.get("all") is True
    if not every and not (
        isinstance(ids, list)
        and 0 < len(ids) <= MAX_REQUEUE_IDS
        and all(isinstance(i, str) and DEAD_ID.fullmatch(i) for i in ids)
    ):
        raise invalid(f'send {{"ids": [up to {MAX_REQUEUE_IDS} dead-letter ids]}} or {{"all": true}}', param="ids")
    client = request.app.state.namespaces.client(viewer.namespace)
    new_ids, skipped, failed = await requeue_async(client.redis, client.keys, None if every else ids)
    return reply(
        {
            "requeued": len(new_ids),
            "skipped": len(skipped),
            "failed": [{"dead_id": letter.dead_id, "why": why} for letter, why in failed[:MAX_REQUEUE_IDS]],
        }
    )


@router.get("/api/batches")
async def batches(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    client = request.app.state.namespaces.client(viewer.namespace)
    try:
        found, more = await BatchStore(client.redis, viewer.namespace).list_batches(BATCHES_SHOWN, None)
    except (KeyError, ValueError, TypeError):  # a batch hash a writer clobbered
        return reply({"batches": [], "more": False, "error": "a batch record is unreadable"})
    shown = [
        {
            "id": b["id"],
            "status": b["status"],
            "endpoint": b["endpoint"],
            "model": b.get("model") or "",
            "created_at": b["created_at"],
            "request_counts": b["request_counts"],
        }
        for b in found
    ]
    return reply({"batches": shown, "more": more})


@router.get("/api/job/{job_id}")
async def job(job_id: str, request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    if not valid_job_id(job_id):
        raise OpenAIError(404, "no such job (not a valid job id)", param="job_id", code="not_found")
    client = request.app.state.namespaces.client(viewer.namespace)
    return reply(lookup_from(job_id, await client.redis.eval(*lookup_args(client.keys, job_id))))
