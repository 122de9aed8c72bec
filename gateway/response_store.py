"""Stored responses (`store`, `previous_response_id`, background polling): one JSON value per
response at `<ns>:response:<id>` with a TTL, holding the response object and the chat
history a next response continues (its messages without the instructions, and its output).
One key per command: the same in cluster mode."""

from __future__ import annotations

import json
import re
from typing import Any

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
MAX_RECORD_BYTES = 16 * 1024 * 1024  # a record read back larger than this is not ours


class ResponseStore:
    def __init__(self, redis: Any, namespace: str, ttl_s: int) -> None:
        self.redis = redis
        self.namespace = namespace
        self.ttl_s = ttl_s

    def key(self, response_id: str) -> str:
        return f"{self.namespace}:response:{response_id}"

    async def save(self, response: dict, messages: list[dict], job_id: str) -> None:
        record = {"response": response, "messages": messages, "job_id": job_id}
        await self.redis.set(self.key(response["id"]), json.dumps(record, ensure_ascii=False), ex=self.ttl_s)

    async def load(self, response_id: str) -> dict | None:
        """The record, or None (unknown id, expired, or not a record: the key is producer-writable)."""
        if not RESPONSE_ID.match(response_id):
            return None
        raw = await self.redis.get(self.key(response_id))
        if raw is None or len(raw) > MAX_RECORD_BYTES:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        valid = (
            isinstance(record, dict)
            and isinstance(record.get("response"), dict)
            and isinstance(record.get("messages"), list)
            and isinstance(record.get("job_id"), str)
        )
        return record if valid else None

    async def delete(self, response_id: str) -> bool:
        return bool(RESPONSE_ID.match(response_id)) and bool(await self.redis.delete(self.key(response_id)))
