"""OpenAI's usage API over the replicas' usage counters (clients/usage.py): GET
/v1/organization/usage/completions, daily buckets; a namespace is a project. An admin key
(keys file: ``admin: true``) sees every configured namespace, any other key its own; with no
keys configured, the gateway's namespace."""

from __future__ import annotations

import datetime

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from conveyor.apps.openai_api.errors import OpenAIError
from conveyor.clients.usage import UsageRow, read_usage_async
from conveyor.gateway.dashboard_access import Viewer, viewer_of

router = APIRouter()
DAY_S = 86_400
DEFAULT_BUCKETS, MAX_BUCKETS = 7, 31  # OpenAI's limits for bucket_width=1d
MAX_TIME = 253_402_300_799 - (MAX_BUCKETS + 1) * DAY_S  # days past it would leave year 9999
GROUPS = ("project_id", "model")


@router.get("/v1/organization/usage/completions")
async def completions_usage(request: Request, viewer: Viewer = Depends(viewer_of)) -> JSONResponse:
    query = request.query_params
    start = _day_of(_integer(query.get("start_time"), "start_time", required=True))
    if query.get("page"):  # next_page: the first day not yet returned
        start = _day_of(_integer(query.get("page"), "page", required=True))
    now = datetime.datetime.now(datetime.timezone.utc).timestamp()
    end_time = _integer(query.get("end_time"), "end_time")
    end_time = int(now) + 1 if end_time is None else end_time
    if query.get("bucket_width", "1d") != "1d":
        raise OpenAIError(400, "bucket_width: only 1d is kept (daily counters)", param="bucket_width")
    limit = _integer(query.get("limit"), "limit", top=MAX_BUCKETS)
    limit = DEFAULT_BUCKETS if limit is None else limit
    if limit < 1:
        raise OpenAIError(400, f"limit: 1 to {MAX_BUCKETS} buckets of 1d", param="limit")
    group_by = _group_by(query.getlist("group_by"))
    projects = _projects(viewer, query.getlist("project_ids"))
    last = _day_of(end_time - 1)
    if last < start:
        raise OpenAIError(400, "end_time: before start_time", param="end_time")
    end = min(last, start + datetime.timedelta(days=limit - 1))
    rows = {}
    for project in projects:
        client = request.app.state.namespaces.client(project)
        rows[project], _ = await read_usage_async(client.redis, client.keys, start, end)
    body = {
        "object": "page",
        "data": [_bucket(start + datetime.timedelta(days=n), rows, group_by) for n in range((end - start).days + 1)],
        "has_more": end < last,
        "next_page": str(_epoch(end) + DAY_S) if end < last else None,
    }
    return JSONResponse(body)


def _bucket(day: datetime.date, rows: dict[str, list[UsageRow]], group_by: tuple[str, ...]) -> dict:
    totals: dict[tuple, dict] = {}
    for project, project_rows in rows.items():
        for row in project_rows:
            if row.day != day.isoformat():
                continue
            key = (project if "project_id" in group_by else None, row.model if "model" in group_by else None)
            result = totals.setdefault(key, _result(*key))
            result["num_model_requests"] += row.jobs
            result["input_tokens"] += row.prompt_tokens
            result["output_tokens"] += row.completion_tokens
            result["input_cached_tokens"] += row.cached_tokens
    start = _epoch(day)
    return {"object": "bucket", "start_time": start, "end_time": start + DAY_S, "results": list(totals.values())}


def _result(project: str | None, model: str | None) -> dict:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": 0,
        "output_tokens": 0,
        "input_cached_tokens": 0,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": 0,
        "project_id": project,
        "user_id": None,
        "api_key_id": None,
        "model": model,
        "batch": None,
    }


def _projects(viewer: Viewer, asked: list[str]) -> tuple[str, ...]:
    """The namespaces to report: those asked (each one the key may see), else all it may see."""
    allowed = viewer.namespaces  # an admin key's: every configured one; any other key's: its own
    for project in asked:
        if project not in allowed:
            raise OpenAIError(403, "project_ids: this key may not see that project", code="permission_denied")
    return tuple(dict.fromkeys(asked)) or allowed


def _group_by(values: list[str]) -> tuple[str, ...]:
    for value in values:
        if value not in GROUPS:
            raise OpenAIError(400, f"group_by: one or more of {', '.join(GROUPS)}", param="group_by")
    return tuple(values)


def _integer(text: str | None, name: str, required: bool = False, top: int = MAX_TIME) -> int | None:
    if text is None or text == "":
        if required:
            raise OpenAIError(400, f"{name}: a Unix time in seconds is required", param=name)
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 12 and int(text) <= top):
        raise OpenAIError(400, f"{name}: an integer from 0 to {top}", param=name)
    return int(text)


def _day_of(seconds: int) -> datetime.date:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).date()


def _epoch(day: datetime.date) -> int:
    return int(datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc).timestamp())
