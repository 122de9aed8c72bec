"""The dashboard's JSON replies: every string cut (values are producer input) and the page's
security headers (a Content-Security-Policy that allows no inline script, no framing)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

MAX_TEXT = 200  # characters of any string a reply carries, unless a route allows more
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def bounded(value: Any, limit: int = MAX_TEXT) -> Any:
    """`value` with every string (dict keys too) cut to `limit` characters."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 1] + "…"
    if isinstance(value, dict):
        return {bounded(str(k), limit): bounded(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bounded(v, limit) for v in value]
    return value


def reply(body: dict[str, Any], status: int = 200, limit: int = MAX_TEXT) -> JSONResponse:
    return JSONResponse(bounded(body, limit), status_code=status, headers=HEADERS)
