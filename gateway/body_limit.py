"""Every request body bounded before it is buffered: an ASGI middleware counts the bytes as
they arrive (Content-Length or chunked alike) and cuts a body at its route's limit or when
it has not all arrived within the body timeout; `read_json` parses a bounded body into an
object no deeper than MAX_JSON_DEPTH (a 400, never a RecursionError's 500)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from starlette.requests import ClientDisconnect, Request

from conveyor.apps.openai_api.errors import OpenAIError, invalid
from conveyor.apps.openai_api.json_bounds import MAX_JSON_DEPTH, depth_over, parse_object, too_deep  # noqa: F401


class BodyTooLarge(OpenAIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over the limit of {limit} bytes", code="body_too_large")


class BodyTooSlow(OpenAIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408, f"the request body did not arrive within {timeout_s:g} s (body timeout)", code="body_timeout"
        )


class BodyLimit:
    """Pure ASGI: `limit_of(path)` bytes per request body, all of it within `timeout_s`.

    The wrapped `receive` raises BodyTooLarge / BodyTooSlow to whoever reads the body (the
    routes' error handlers answer it); a response not yet started is answered here."""

    def __init__(self, app: Any, limit_of: Callable[[str], int], timeout_s: float) -> None:
        self.app, self.limit_of, self.timeout_s = app, limit_of, timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_of(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _reply(send, BodyTooLarge(limit))
        started = {"response": False}

        async def sending(message: dict) -> None:
            started["response"] = True
            await send(message)

        try:
            await self.app(scope, _counted(receive, limit, time.monotonic() + self.timeout_s, self.timeout_s), sending)
        except (BodyTooLarge, BodyTooSlow) as exc:
            if started["response"]:
                raise
            await _reply(send, exc)


def _counted(receive: Callable, limit: int, deadline: float, timeout_s: float) -> Callable:
    size, complete = 0, False

    async def counted() -> dict:
        nonlocal size, complete
        if complete:  # the body is in: what follows is the wait for a disconnect, unbounded
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BodyTooSlow(timeout_s) from None
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise BodyTooLarge(limit)
            complete = not message.get("more_body", False)
        return message

    return counted


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _reply(send: Callable, error: OpenAIError) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- JSON bodies


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object of at most `limit` bytes (413) and MAX_JSON_DEPTH levels (400)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise invalid("the client went away before sending the whole body", code="body_incomplete") from None
    return parse_object(b"".join(chunks))
