"""Each tenant's share of one gateway: at most `limit` requests of one namespace in flight
at once (its keys together; unknown keys share one more bucket), from the first byte read
to the last byte of the response, streams included. Past it: 429 at once, before the body
is read, so one tenant's flood of slow or long requests leaves the others their share."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

from conveyor.apps.openai_api.errors import OpenAIError

UNMETERED = ("/health", "/metrics")
UNKNOWN = "\0unknown"  # the bucket of requests whose key maps to no tenant (they get a 401)


class TenantShare:
    """Pure ASGI; `tenant_of_key(key or None)` -> namespace or None."""

    def __init__(self, app: Any, tenant_of_key: Callable[[str | None], str | None], limit: int) -> None:
        self.app, self.tenant_of_key, self.limit = app, tenant_of_key, limit
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in UNMETERED:
            return await self.app(scope, receive, send)
        bucket = self.tenant_of_key(_bearer(scope)) or UNKNOWN
        if self.in_flight[bucket] >= self.limit:
            return await _too_many(send, self.limit)
        self.in_flight[bucket] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[bucket] -= 1
            if not self.in_flight[bucket]:
                del self.in_flight[bucket]


def _bearer(scope: dict) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" else None
    return None


async def _too_many(send: Callable, limit: int) -> None:
    error = OpenAIError(
        429,
        f"this tenant has {limit} requests in flight on this gateway, the limit "
        "(--max-requests-per-tenant): try again when one has finished",
        code="tenant_busy",
    )
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
