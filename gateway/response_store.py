"""Stored responses (`store`, `previous_response_id`, background polling): one JSON value per
response at `<ns>:response:<id>` with a TTL, holding the response object and the chat
history a next response continues (its messages without the instructions, and its output).
One key per command: the same in cluster mode.

Each namespace may hold at most `max_bytes` of records at once (--max-stored-bytes): a new
record is admitted (reserve) before its job is submitted, else 429 (413 for one alone over
the limit). The accounting lives in three keys with one hash tag, `<ns>:{<ns>}:stored:*`
(a script updates them together, in cluster mode too): a hash id -> bytes, a sorted set id
-> expiry (Redis TIME + ttl, as the record's own TTL), the sum, and the background responses
not seen final yet (`pending`: when the namespace is full, responses.py settles them, which
drops the input of those whose job failed). Each script first forgets up to SWEEP_BATCH
expired entries, so what expires or is deleted leaves the sum. The keys are producer-writable:
a key of the wrong type resets the namespace's count (a scribbler only forgets its own bytes).
Updates of an admitted record (a background response's final state, a completed response
with its output) are counted but never refused: the output is bounded by the work caps."""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.apps.openai_api.errors import OpenAIError
from conveyor.clients.webhook_queue import MAX_PENDING_EVENTS, event_args

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
MAX_RECORD_BYTES = 16 * 1024 * 1024  # a record read back larger than this is not ours
SWEEP_BATCH = 1000  # expired entries one script forgets at most
EVENT_OF_STATUS = {  # a background response's final status -> its webhook event
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}

# KEYS: sizes (hash), expiry (zset), total (string), pending (zset: background responses not yet
# seen final), and the namespace's webhook events stream when it has a webhook. ARGV: id, bytes
# (-1: forget it), ttl_s, budget (0: never refuse), pending (1 or 0), then the stream's bound
# and the fields of the event to queue when this record leaves `pending` (a final save).
# Reply: {1, total} counted, {0, total} refused (nothing changed but the sweep).
ACCOUNT_LUA = (
    """
-- the keys are producer-writable: one of the wrong type (WRONGTYPE) resets the count, never fails
local probes = {{'HLEN', 1}, {'ZCARD', 2}, {'STRLEN', 3}, {'ZCARD', 4}}
for _, probe in ipairs(probes) do
  local reply = redis.pcall(probe[1], KEYS[probe[2]])
  if type(reply) == 'table' and reply['err'] then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
    break
  end
end
local now = tonumber(redis.call('TIME')[1])
local ttl = tonumber(ARGV[3])
local total = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, %d)) do
  total = total - (tonumber(redis.call('HGET', KEYS[1], id) or '0') or 0)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if total < 0 then total = 0 end
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
local size = tonumber(ARGV[2])
local budget = tonumber(ARGV[4])
local verdict = 1
if size < 0 then
  total = total - old
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
elseif budget > 0 and size > old and total - old + size > budget then
  verdict = 0
else
  total = total - old + size
  redis.call('HSET', KEYS[1], ARGV[1], size)
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
  if ARGV[5] == '1' then
    redis.call('ZADD', KEYS[4], now + ttl, ARGV[1])
  elseif redis.call('ZREM', KEYS[4], ARGV[1]) == 1 and KEYS[5] and #ARGV > 6 then
    -- a background response seen final for the first time: its webhook event, once
    redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', unpack(ARGV, 7))
  end
end
if total < 0 then total = 0 end
redis.call('SET', KEYS[3], total)
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl + 60) end
return {verdict, total}
"""
    % SWEEP_BATCH
)


class StoreFull(OpenAIError):
    """429: the namespace's stored responses are at the limit; 413: this one alone is over it."""

    def __init__(self, size: int, used: int, limit: int) -> None:
        if size > limit:
            super().__init__(
                413,
                f"this response would store {size} bytes (its input and history), over this gateway's limit of "
                f"{limit} bytes of stored responses per tenant (--max-stored-bytes): send a smaller input, or "
                "store: false",
                param="input",
                code="stored_bytes_limit",
            )
        else:
            super().__init__(
                429,
                f"this tenant's stored responses hold {used} bytes; {size} more would pass this gateway's limit of "
                f"{limit} bytes (--max-stored-bytes): delete some (DELETE /v1/responses/{{id}}), wait for them to "
                "expire, or send store: false",
                code="stored_bytes_full",
            )


class ResponseStore:
    def __init__(
        self, redis: Any, namespace: str, ttl_s: int, max_bytes: int = 0, events_stream: str | None = None
    ) -> None:
        """`events_stream`: the namespace's webhook events stream (Keys.webhooks) when it has a
        webhook: a background response saved final the first time queues its response.* event."""
        self.redis = redis
        self.namespace = namespace
        self.events_stream = events_stream
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes  # 0: no limit
        tag = f"{namespace}:{{{namespace}}}:stored"
        self.usage_keys = [f"{tag}:sizes", f"{tag}:expiry", f"{tag}:bytes", f"{tag}:pending"]
        self._account_script = redis.register_script(ACCOUNT_LUA)

    def key(self, response_id: str) -> str:
        return f"{self.namespace}:response:{response_id}"

    @staticmethod
    def encode(response: dict, messages: list[dict], job_id: str) -> bytes:
        record = {"response": response, "messages": messages, "job_id": job_id}
        return json.dumps(record, ensure_ascii=False).encode()

    async def reserve(self, response: dict, messages: list[dict], job_id: str) -> None:
        """Admit a new record of this size (StoreFull when the namespace has no room for it)."""
        size = len(self.encode(response, messages, job_id))
        if self.max_bytes and size > self.max_bytes:
            raise StoreFull(size, 0, self.max_bytes)
        verdict, used = await self._account(response["id"], size, self.max_bytes)
        if not verdict:
            raise StoreFull(size, used, self.max_bytes)

    async def release(self, response_id: str) -> None:
        """Forget a reservation whose record will never be written (its job could not run)."""
        await self._account(response_id, -1, 0)

    async def save(self, response: dict, messages: list[dict], job_id: str) -> None:
        """Write the record (admitted by reserve, or an update of one): counted, never refused.
        A background response not final yet is listed as pending (see pending())."""
        data = self.encode(response, messages, job_id)
        pending = response.get("background") is True and response.get("status") in ("queued", "in_progress")
        event = None if pending else EVENT_OF_STATUS.get(response.get("status"))
        await self._account(response["id"], len(data), 0, pending, event)
        await self.redis.set(self.key(response["id"]), data, ex=self.ttl_s)

    async def pending(self, limit: int) -> list[str]:
        """Up to `limit` background responses saved before their job ended, the oldest first."""
        ids = await self.redis.zrange(self.usage_keys[3], 0, limit - 1)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def _account(
        self, response_id: str, size: int, budget: int, pending: bool = False, event: str | None = None
    ) -> tuple[int, int]:
        keys, args = list(self.usage_keys), [response_id, size, self.ttl_s, budget, int(pending)]
        if event and self.events_stream:
            keys.append(self.events_stream)
            args += [MAX_PENDING_EVENTS, *event_args(event, response_id)]
        reply = await self._account_script(keys=keys, args=args)
        return int(reply[0]), int(reply[1])

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
        if not RESPONSE_ID.match(response_id):
            return False
        deleted = bool(await self.redis.delete(self.key(response_id)))
        await self.release(response_id)
        return deleted
