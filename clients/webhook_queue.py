"""Webhook events waiting for delivery: one Redis stream per namespace (Keys.webhooks).

Whoever sees an outcome queues its event here (the replica for `job.*` of jobs that asked
with `webhook: true`, the gateway for `batch.*` and `response.*`); the gateway's sender
(gateway/webhooks.py) delivers them to the address the operator configured for the
namespace, signed as Standard Webhooks, at least once. No producer ever names an address.

An entry's fields: `id` (the event id, kept across retries: the `webhook-id` header),
`type`, `created_at` (epoch seconds) and `data_id` (the batch, response or job id).
The body sent is OpenAI's event shape: {"id", "object": "event", "type", "created_at",
"data": {"id"}}.
"""

from __future__ import annotations

import json
import re
import secrets
import time

WEBHOOK_GROUP = "webhook-senders"
MAX_PENDING_EVENTS = 100_000  # the stream's bound (approximate trim): a namespace nobody delivers for
MAX_DEAD_EVENTS = 10_000  # the dead letters' bound (approximate trim)
EVENT_FIELDS = ("id", "type", "created_at", "data_id")
EVENT_ID = re.compile(r"evt_[A-Za-z0-9_-]{1,128}")
DATA_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
MAX_FUTURE_S = 86_400  # a created_at further ahead than this (clock skew beyond it) is junk
EVENT_TYPES = (
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
    "job.completed",
    "job.failed",
)


def new_event(event_type: str, data_id: str, created_at: float | None = None) -> dict[str, str]:
    """The stream entry of one event (its id is fixed here, once)."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {event_type!r}")
    return {
        "id": "evt_" + secrets.token_hex(16),
        "type": event_type,
        "created_at": str(int(created_at if created_at is not None else time.time())),
        "data_id": data_id,
    }


def event_args(event_type: str, data_id: str) -> list[str]:
    """A new event's fields as a flat list (field, value, ...): what a script XADDs."""
    return [item for pair in new_event(event_type, data_id).items() for item in pair]


def queue_event(redis_or_pipe, stream: str, event_type: str, data_id: str):
    """XADD the event to `stream` (a pipeline queues it; a client returns the awaitable/reply)."""
    return redis_or_pipe.xadd(stream, new_event(event_type, data_id), maxlen=MAX_PENDING_EVENTS, approximate=True)


def event_body(fields: dict) -> bytes:
    """The JSON body of an event entry, as sent (compact, so the signed bytes are these)."""
    text = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
    return json.dumps(
        {
            "id": text["id"],
            "object": "event",
            "type": text["type"],
            "created_at": int(text["created_at"]),
            "data": {"id": text["data_id"]},
        },
        separators=(",", ":"),
    ).encode()


def check_event(fields: dict) -> dict[str, str]:
    """The text fields of a stream entry, checked (ValueError naming the field and its rule):
    the stream is writable by whoever may write the namespace, so an entry is input."""
    text = {}
    for name in EVENT_FIELDS:
        value = fields.get(name, fields.get(name.encode()))
        if value is None:
            raise ValueError(f"field {name!r} is missing")
        try:
            text[name] = value.decode() if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            raise ValueError(f"field {name!r} is not UTF-8") from None
    if not EVENT_ID.fullmatch(text["id"]):
        raise ValueError("field 'id' must be 'evt_' and 1 to 128 characters of A-Z a-z 0-9 _ -")
    if text["type"] not in EVENT_TYPES:
        raise ValueError(f"field 'type' must be one of {', '.join(EVENT_TYPES)}")
    if not DATA_ID.fullmatch(text["data_id"]):
        raise ValueError("field 'data_id' must be 1 to 256 characters of A-Z a-z 0-9 _ . : -")
    if not text["created_at"].isdigit() or not 0 < int(text["created_at"]) <= time.time() + MAX_FUTURE_S:
        raise ValueError("field 'created_at' must be epoch seconds (an integer, not a day ahead of now)")
    return text
