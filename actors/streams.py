"""Redis Streams operations of a replica: consumer groups, reading, fenced finishing,
dead letters. Every key it creates except the request streams gets a TTL."""
import time
from typing import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from actors.messages import Delivery
from actors.resilience import retrying
from clients.keys import GROUP, Keys

# Start an attempt: count the delivery, unless this entry is a second submission of a job
# that already has one, or of a job that already finished (e.g. reclaimed just before its
# owner's finish acked it): a duplicate, not run again; another payload: a conflict.
# KEYS: job hash. ARGV: entry id, ttl, now, payload digest.
# Returns {attempt, cancel flag} or {-1 duplicate | -2 conflict, ''}.
START_LUA = """
local state = redis.call('HMGET', KEYS[1], 'entry', 'digest', 'cancel', 'finished_attempt')
if state[2] and state[2] ~= ARGV[4] then return {-2, ''} end
if state[1] and state[1] ~= ARGV[1] then return {-1, ''} end
if state[4] then return {-1, ''} end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'updated', ARGV[3], 'entry', ARGV[1], 'digest', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {attempt, state[3] or ''}
"""
DUPLICATE, CONFLICT = -1, -2
DEAD_LETTER_MAXLEN = 100_000
DEAD_LETTER_TTL_S = 7 * 86_400  # refreshed on every dead letter

# Terminal event + status + ack, only while this replica's attempt is the latest (fencing:
# a stale owner whose job was reclaimed must not publish a final result over the new one).
# Idempotent: a retry after a lost reply does not add a second terminal event.
# KEYS: job hash, out stream, request stream. ARGV: attempt, status, type, data, ttl, group,
# entry id, now. Returns 1 when written, 0 when fenced off.
FINISH_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
if current > tonumber(ARGV[1]) then return 0 end
if redis.call('HGET', KEYS[1], 'finished_attempt') ~= ARGV[1] then
  redis.call('XADD', KEYS[2], '*', 'type', ARGV[3], 'data', ARGV[4])
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'result', ARGV[4], 'updated', ARGV[8],
           'finished_attempt', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('XACK', KEYS[3], ARGV[6], ARGV[7])
redis.call('XDEL', KEYS[3], ARGV[7])
return 1
"""


class Streams:
    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, model_name: str):
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        # the default streams and this model's own, interactive ones first
        self.request_streams = (keys.interactive, keys.model_requests(model_name, "interactive"),
                                keys.batch, keys.model_requests(model_name, "batch"))
        self.finish_script = client.register_script(FINISH_LUA)
        self.start_script = client.register_script(START_LUA)

    async def resilient(self, operation: Callable[[], Awaitable], what: str):
        """``operation`` retried through outages; recreates lost consumer groups."""
        return await retrying(operation, what, self.ensure_groups)

    async def write(self, queue_commands: Callable[[object], Awaitable[None]], what: str) -> None:
        """One pipelined round trip, rebuilt and resent until it goes through."""
        async def attempt():
            async with self.redis.pipeline(transaction=False) as pipe:
                await queue_commands(pipe)
                await pipe.execute()
        await self.resilient(attempt, what)

    async def ensure_groups(self) -> None:
        for stream in self.request_streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read_new(self, count: int, block_ms: int) -> list[tuple[str, str, dict]]:
        """Up to ``count`` new entries, interactive first; blocks only when both are empty."""
        async def read():
            entries = []
            for stream in self.request_streams:
                if len(entries) < count:
                    entries += await self._read({stream: ">"}, count - len(entries), None)
            if not entries:
                entries = await self._read({s: ">" for s in self.request_streams}, count, block_ms)
            return entries
        return await self.resilient(read, "read jobs")

    async def _read(self, streams: dict, count: int, block_ms: int | None):
        reply = await self.redis.xreadgroup(GROUP, self.consumer, streams, count=count, block=block_ms)
        return [(_text(stream), _text(entry_id), fields)
                for stream, items in (reply or []) for entry_id, fields in items if fields is not None]

    async def start_attempt(self, job_id: str, entry_id: str, ttl: int, digest: str) -> tuple[int, bool]:
        """Count this delivery on the job hash; returns (attempt or DUPLICATE/CONFLICT, cancel requested)."""
        attempt, cancel = await self.resilient(lambda: self.start_script(
            keys=[self.keys.job(job_id)], args=[entry_id, ttl, repr(time.time()), digest]), "start job")
        return int(attempt), cancel == b"1"

    async def queue_finish(self, pipe, delivery: Delivery, status: str, event: dict[str, bytes]) -> None:
        await self.finish_script(
            keys=[self.keys.job(delivery.job_id), self.keys.out(delivery.job_id), delivery.stream],
            args=[delivery.attempt, status, event["type"], event["data"], delivery.result_ttl, GROUP,
                  delivery.entry_id, repr(time.time())], client=pipe)

    def queue_dead_letter(self, pipe, stream: str, entry_id: str, reason: str, fields: dict | None) -> None:
        entry = {"stream": stream, "entry_id": entry_id, "reason": reason[:4096], "at": repr(time.time())}
        for name, value in (fields or {}).items():
            entry[f"field:{_text(name)}"] = value
        pipe.xadd(self.keys.dead, entry, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.expire(self.keys.dead, DEAD_LETTER_TTL_S)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
