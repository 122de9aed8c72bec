"""One delivery attempt of one webhook event: a signed POST, 2xx or the reason it failed.

The receiver is outside our trust: an attempt never follows a redirect (3xx is a failure),
ends after the target's timeout whatever the receiver does (slow headers, a trickled body),
and reads at most MAX_ANSWER_BYTES of the answer, raw (never inflated), for the reason.
"""

from __future__ import annotations

import asyncio

import httpx

from conveyor.gateway.webhook_config import WebhookTarget
from conveyor.gateway.webhook_signing import signed_headers

MAX_ANSWER_BYTES = 4096  # of a failed answer's body, kept for the reason
MAX_REASON_CHARS = 200


def http_client(target: WebhookTarget) -> httpx.AsyncClient:
    """A namespace's own client: its connections are bounded by its concurrency, so a receiver
    that never answers holds only its own namespace's connections."""
    limits = httpx.Limits(max_connections=target.concurrency, max_keepalive_connections=target.concurrency)
    # httpx's own per-step timeouts are a backstop: attempt() bounds the whole attempt first
    return httpx.AsyncClient(follow_redirects=False, timeout=target.timeout_s + 1, limits=limits)


async def attempt(http: httpx.AsyncClient, target: WebhookTarget, event_id: str, body: bytes) -> str | None:
    """POST the event once: None when the receiver answered 2xx, else why not (<= 200 chars)."""
    headers = signed_headers(target.key, event_id, body)
    try:
        return await asyncio.wait_for(_post(http, target.url, body, headers), target.timeout_s)
    except asyncio.TimeoutError:
        return f"no answer within {target.timeout_s:g} s"
    except httpx.HTTPError as exc:
        return cut(f"{type(exc).__name__}: {exc}")


async def _post(http: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]) -> str | None:
    async with http.stream("POST", url, content=body, headers=headers) as response:
        if 200 <= response.status_code < 300:
            return None  # the body is not read: closing the response drops the connection if need be
        answer = await _head(response)
        where = f" (to {response.headers.get('location', '')[:80]!r}, not followed)" if response.is_redirect else ""
        return cut(f"HTTP {response.status_code}{where}" + (f": {answer}" if answer else ""))


async def _head(response: httpx.Response) -> str:
    """The first bytes of the answer, as printable text."""
    head = b""
    async for chunk in response.aiter_raw():
        head += chunk
        if len(head) >= MAX_ANSWER_BYTES:
            break
    text = head[:MAX_ANSWER_BYTES].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text).strip()


def cut(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
