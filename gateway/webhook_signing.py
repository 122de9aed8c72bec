"""Standard Webhooks signatures (https://www.standardwebhooks.com/, what OpenAI's webhooks use).

Each attempt carries `webhook-id` (the event's id, the same on every retry: receivers
deduplicate on it), `webhook-timestamp` (integer seconds, now) and `webhook-signature`:
`v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")), the key being the bytes the
secret `whsec_<base64>` decodes to (webhook_config.read_secret).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from importlib import metadata


def _version() -> str:
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        return "0"


USER_AGENT = f"Conveyor-Webhooks/{_version()}"


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value of one attempt."""
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(key: bytes, event_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """Every header of one attempt (the timestamp: now, unless given)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, event_id, timestamp, body),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "accept-encoding": "identity",  # the answer is read raw, a few KiB at most: nothing to inflate
    }
