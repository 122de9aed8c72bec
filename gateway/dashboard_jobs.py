"""The dashboard's job page and lists of jobs (under `/dashboard/api/`, with the access rules
of dashboard_access.py: any viewer reads its namespace, an actor cancels and retries).

- GET  /jobs/{job_id}: one job (gateway/job_pages.py); 400 for a job id that is not one,
  404 for a job with neither a hash nor a dead letter.
- POST /jobs/{job_id}/cancel: CANCEL_LUA, as `Client.job(id).cancel()`; 409 when the job
  is unknown or finished.
- POST /jobs/{job_id}/retry: requeue the job's newest requeueable dead letter with the rules
  and the script of `conveyor dead requeue` (clients/dead_letters.py); 409 when it has none.
- GET  /jobs?state=queued|running|done|failed&cursor=: a page of jobs (gateway/job_lists.py).
- GET  /webhooks/dead?before=: webhook dead letters, newest first."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from conveyor.apps.openai_api.errors import OpenAIError, invalid
from conveyor.clients.dead_letters import requeue_async
from conveyor.clients.job_lookup import valid_job_id
from conveyor.gateway import job_lists, job_pages
from conveyor.gateway.dashboard_access import Viewer, actor_of, viewer_of
from conveyor.gateway.dashboard_replies import reply

router = APIRouter(prefix="/api")
FAILED_STATUSES = ("error", "cancelled", "unknown")  # whose dead letters are looked for


def _reply(body: dict[str, Any], status: int = 200) -> JSONResponse:
    """job_pages cut each text to its own bound (RESULT_CHARS at most): no further cut here."""
    return reply(body, status, limit=job_pages.RESULT_CHARS)


def _client(request: Request, viewer: Viewer) -> Any:
    return request.app.state.namespaces.client(viewer.namespace)


def _checked(job_id: str) -> str:
    if not valid_job_id(job_id):
        shown = job_id if len(job_id) <= 64 else job_id[:63] + "…"
        raise invalid(f"not a valid job id: {shown!r} (1 to 128 of A-Z a-z 0-9 _ . : -)", param="job_id")
    return job_id


@router.get("/jobs/{job_id}")
async def job_page(job_id: str, request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    client = _client(request, viewer)
    redis, keys = client.redis, client.keys
    try:
        job = await job_pages.read_job(redis, keys, _checked(job_id))
    except job_pages.NotAJobHash as exc:
        job = {"job_id": job_id, "status": "unreadable", "error": f"its key holds a {str(exc)[:20]}, not a job hash"}
    letters = []
    if job is None or job["status"] in FAILED_STATUSES:
        letters = [job_pages.letter_view(keys, s) for s in await job_pages.dead_letters_of(redis, keys, job_id)]
    if job is None and not letters:
        raise OpenAIError(404, f"no job {job_id!r} in namespace {viewer.namespace!r}", param="job_id", code="not_found")
    job = job or {"job_id": job_id, "status": "unknown", "error": "no job hash (expired, or never started)"}
    return _reply(
        {
            **job,
            "namespace": viewer.namespace,
            "may_act": viewer.may_act,
            "dead_letters": letters,
            "cancellable": job["status"] in ("queued", "running") and not job.get("cancel_requested"),
            "retryable": any(letter["requeueable"] for letter in letters),
        }
    )


@router.post("/jobs/{job_id}/cancel")
async def cancel(job_id: str, request: Request, viewer: Viewer = Depends(actor_of)) -> JSONResponse:
    client = _client(request, viewer)
    if not await job_pages.cancel_job(client.redis, client.keys, _checked(job_id)):
        raise OpenAIError(409, f"job {job_id!r} is unknown or finished: nothing to cancel", code="not_cancellable")
    return _reply({"job_id": job_id, "cancel_requested": True})


@router.post("/jobs/{job_id}/retry")
async def retry(job_id: str, request: Request, viewer: Viewer = Depends(actor_of)) -> JSONResponse:
    client = _client(request, viewer)
    redis, keys = client.redis, client.keys
    letters = await job_pages.dead_letters_of(redis, keys, _checked(job_id))
    chosen = next((s for s in letters if job_pages.letter_view(keys, s)["requeueable"]), None)
    if chosen is None:
        raise OpenAIError(
            409,
            f"job {job_id!r} has no requeueable dead letter among the newest {job_pages.DEAD_SEARCHED}",
            code="not_retryable",
        )
    new_ids, _, failed = await requeue_async(redis, keys, [chosen.letter.dead_id])
    if failed or not new_ids:
        why = failed[0][1] if failed else "the dead letter is gone (requeued meanwhile?)"
        raise OpenAIError(409, f"job {job_id!r} was not requeued: {why}", code="not_retryable")
    return _reply({"job_id": job_id, "requeued": chosen.letter.dead_id, "entry": new_ids[0]})


@router.get("/jobs")
async def jobs(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    state = request.query_params.get("state", "")
    if state not in job_lists.STATES:
        raise invalid(f"state must be one of {', '.join(job_lists.STATES)}, got {state[:40]!r}", param="state")
    text = request.query_params.get("cursor")
    try:
        cursor = job_lists.parse_cursor(text)
    except ValueError:
        raise invalid(f"not a cursor of this list: {text[:40]!r} (send the `next` of a page)", param="cursor") from None
    client = _client(request, viewer)
    rows, after = await job_lists.list_jobs(client.redis, client.keys, state, cursor)
    return _reply({"state": state, "jobs": rows, "next": after.text() if after else None})


@router.get("/webhooks/dead")
async def webhook_dead_letters(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    before = request.query_params.get("before") or None
    if before is not None and not job_lists.STREAM_ID.fullmatch(before):
        raise invalid(f"before must be a stream id, got {before[:40]!r}", param="before")
    client = _client(request, viewer)
    letters, after = await job_lists.webhook_dead_page(client.redis, client.keys, before)
    total = await client.redis.xlen(client.keys.webhooks_dead) if letters else 0
    return _reply({"letters": letters, "total": total, "next": after})
