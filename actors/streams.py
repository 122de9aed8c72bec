"""Redis Streams operations of a replica: consumer groups, byte-bounded reading, fenced
finishing, refusals, dead letters. Every key it creates except the request streams gets
a TTL. Everything read back from Redis is producer-writable input: scripts coerce what
they read, and a command that fails for one job fails that job alone."""
import hashlib
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
# A refusal record (status 'rejected', left by an unreadable entry) is no claim: replaced.
# A digest that is not 64 hex digits (the 32-digit form before 0.2, or junk) is not compared.
# KEYS: job hash, out stream. ARGV: entry id, ttl, now, payload digest.
# Returns {attempt, cancel flag} or {-1 duplicate | -2 conflict, ''}.
START_LUA = """
local state = redis.call('HMGET', KEYS[1], 'entry', 'digest', 'cancel', 'finished_attempt', 'status', 'attempt')
if state[5] == 'rejected' then
  redis.call('DEL', KEYS[1], KEYS[2])
  state = {false, false, false, false, false, false}
end
if state[2] and #state[2] == 64 and state[2] ~= ARGV[4] then return {-2, ''} end
if state[1] and state[1] ~= ARGV[1] then return {-1, ''} end
if state[4] then return {-1, ''} end
local attempt = tonumber(state[6])
if not attempt or attempt ~= attempt or attempt < 0 or attempt > 1e9 then attempt = 0 end
attempt = math.floor(attempt) + 1
redis.call('HSET', KEYS[1], 'attempt', attempt, 'status', 'running', 'updated', ARGV[3], 'entry', ARGV[1],
           'digest', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {attempt, state[3] or ''}
"""
DUPLICATE, CONFLICT = -1, -2
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_TTL_S = 7 * 86_400  # refreshed on every dead letter
DEAD_LETTER_PREFIX_BYTES = 256  # what a dead letter keeps of a payload it does not keep whole
REJECT_TTL_S = 3600

# Terminal event + status + ack, only while this replica's attempt is the latest (fencing:
# a stale owner whose job was reclaimed must not publish a final result over the new one).
# Idempotent: a retry after a lost reply does not add a second terminal event.
# KEYS: job hash, out stream, request stream. ARGV: attempt, status, type, data, ttl, group,
# entry id, now. Returns 1 when written, 0 when fenced off.
FINISH_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
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

# Tell the producer of an unreadable entry why it was refused, without touching any job:
# only where no record of that id exists (no hash, no out stream). The hash is marked
# 'rejected' so a later valid submission of the id replaces it (SUBMIT_LUA, START_LUA).
# KEYS: job hash, out stream. ARGV: entry id, event data, ttl, now. Returns 1 or 0.
REJECT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[2], '*', 'type', 'error', 'data', ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'rejected', 'rejected', '1', 'entry', ARGV[1], 'result', ARGV[2],
           'updated', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""

# An entry as a replica may hold it: whole, or, when over `max_bytes`, a stub (its size,
# SHA-1 and a prefix of each field) so its bytes never leave the server.
# Row: {stream index, entry id, size, truncated 0|1, {field, value, ...}}, and its cost in bytes.
SHAPE_LUA = """
local function shape(index, entry, max_bytes, prefix)
  local fields, size = entry[2], 0
  for i = 1, #fields do size = size + #fields[i] end
  if size <= max_bytes then return {index, entry[1], size, 0, fields}, size end
  local stub = {}
  for i = 1, math.min(#fields, 16), 2 do
    stub[#stub + 1] = string.sub(fields[i], 1, 64)
    stub[#stub + 1] = string.sub(fields[i + 1] or '', 1, prefix)
  end
  stub[#stub + 1] = 'sha1'
  stub[#stub + 1] = redis.sha1hex(table.concat(fields, '\\0'))
  return {index, entry[1], size, 1, stub}, prefix
end
"""

# Read new entries without letting their size in: one entry at a time, streams in priority
# order, until `count` entries or `budget` bytes.
# KEYS: request streams. ARGV: group, consumer, count, budget, max_bytes, prefix bytes.
READ_LUA = SHAPE_LUA + """
local count, budget, max_bytes, prefix = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local out, used = {}, 0
for index, stream in ipairs(KEYS) do
  while #out < count and used < budget do
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', stream, '>')
    if not reply then break end
    local row, cost = shape(index, reply[1][2][1], max_bytes, prefix)
    out[#out + 1] = row
    used = used + cost
  end
end
return out
"""

# The same shaping for entries claimed by id (reclaimed from a dead replica).
# KEYS: request stream. ARGV: max_bytes, prefix bytes, entry ids...
READ_IDS_LUA = SHAPE_LUA + """
local out = {}
for i = 3, #ARGV do
  local rows = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if rows[1] then out[#out + 1] = shape(1, rows[1], tonumber(ARGV[1]), tonumber(ARGV[2])) end
end
return out
"""


class ReadEntry:
    """One request-stream entry as read: `fields` is a stub when `truncated`."""
    __slots__ = ("stream", "entry_id", "size", "truncated", "fields")

    def __init__(self, stream: str, entry_id: str, size: int, truncated: bool, fields: dict):
        self.stream, self.entry_id, self.size, self.truncated, self.fields = \
            stream, entry_id, size, truncated, fields


class Streams:
    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, model_name: str,
                 max_entry_bytes: int):
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self.max_entry_bytes = max_entry_bytes
        # the default streams and this model's own, interactive ones first
        self.request_streams = (keys.interactive, keys.model_requests(model_name, "interactive"),
                                keys.batch, keys.model_requests(model_name, "batch"))
        self.finish_script = client.register_script(FINISH_LUA)
        self.start_script = client.register_script(START_LUA)
        self.reject_script = client.register_script(REJECT_LUA)
        self.read_script = client.register_script(READ_LUA)
        self.read_ids_script = client.register_script(READ_IDS_LUA)

    async def resilient(self, operation: Callable[[], Awaitable], what: str):
        """``operation`` retried through outages; recreates lost consumer groups."""
        return await retrying(operation, what, self.ensure_groups)

    async def write(self, queue_commands: Callable[[object], Awaitable[None]], what: str) -> list:
        """One pipelined round trip, rebuilt and resent until it goes through. Returns each
        command's reply; a command that failed (e.g. WRONGTYPE on a key a producer
        clobbered) leaves its ResponseError in the list instead of failing the others."""
        async def attempt():
            async with self.redis.pipeline(transaction=False) as pipe:
                await queue_commands(pipe)
                replies = await pipe.execute(raise_on_error=False)
            lost_group = next((r for r in replies if _is_nogroup(r)), None)
            if lost_group is not None:
                raise lost_group  # retrying recreates the groups and sends it all again
            return replies
        return await self.resilient(attempt, what)

    async def ensure_groups(self) -> None:
        for stream in self.request_streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read_new(self, count: int, byte_budget: int) -> list[ReadEntry]:
        """Up to ``count`` new entries and about ``byte_budget`` bytes, interactive first."""
        args = [GROUP, self.consumer, count, max(1, byte_budget), self.max_entry_bytes, DEAD_LETTER_PREFIX_BYTES]
        rows = await self.resilient(lambda: self.read_script(keys=list(self.request_streams), args=args),
                                    "read jobs")
        return _entries(rows, self.request_streams)

    async def read_ids(self, stream: str, entry_ids: list[str]) -> list[ReadEntry]:
        """The entries ``entry_ids`` of ``stream`` (shaped like read_new's); deleted ones are left out."""
        if not entry_ids:
            return []
        args = [self.max_entry_bytes, DEAD_LETTER_PREFIX_BYTES, *entry_ids]
        rows = await self.resilient(lambda: self.read_ids_script(keys=[stream], args=args), "read claimed")
        entries = _entries(rows, (stream,))
        deleted = set(entry_ids) - {entry.entry_id for entry in entries}
        if deleted:  # deleted while pending: nothing to run (Redis 6.2 still lists them)
            await self.resilient(lambda: self.redis.xack(stream, GROUP, *deleted), "ack deleted")
        return entries

    async def start_attempt(self, job_id: str, entry_id: str, ttl: int, digest: str) -> tuple[int, bool]:
        """Count this delivery on the job hash; returns (attempt or DUPLICATE/CONFLICT, cancel requested).
        Raises ResponseError when the job's keys are unusable (e.g. not a hash)."""
        attempt, cancel = await self.resilient(lambda: self.start_script(
            keys=[self.keys.job(job_id), self.keys.out(job_id)], args=[entry_id, ttl, repr(time.time()), digest]),
            "start job")
        return int(attempt), cancel == b"1"

    async def queue_finish(self, pipe, delivery: Delivery, status: str, event: dict[str, bytes]) -> None:
        await self.finish_script(
            keys=[self.keys.job(delivery.job_id), self.keys.out(delivery.job_id), delivery.stream],
            args=[delivery.attempt, status, event["type"], event["data"], delivery.result_ttl, GROUP,
                  delivery.entry_id, repr(time.time())], client=pipe)

    async def queue_reject(self, pipe, job_id: str, entry_id: str, event_data: bytes) -> None:
        await self.reject_script(keys=[self.keys.job(job_id), self.keys.out(job_id)],
                                 args=[entry_id, event_data, REJECT_TTL_S, repr(time.time())], client=pipe)

    def queue_dead_letter(self, pipe, stream: str, entry_id: str, reason: str, fields: dict | None, *,
                          keep_payload: bool = False, job_id: str | None = None, size: int | None = None,
                          stub: bool = False) -> None:
        """Park an entry in ``<ns>:dead`` and ack it. Only a valid job that may succeed when
        requeued keeps its payload whole; others keep its size, digest and a prefix
        (``stub``: ``fields`` already is READ_LUA's stub of an oversized entry)."""
        entry = {"stream": stream, "entry_id": entry_id, "reason": reason[:4096], "at": repr(time.time())}
        if job_id:
            entry["job_id"] = job_id
        entry.update(_kept_fields(fields or {}, keep_payload, size, stub))
        pipe.xadd(self.keys.dead, entry, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.expire(self.keys.dead, DEAD_LETTER_TTL_S)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)


def _kept_fields(fields: dict, keep_payload: bool, size: int | None, stub: bool) -> dict:
    if keep_payload:
        return {f"field:{_text(name)}": value for name, value in fields.items()}
    fields = dict(fields)
    if stub:
        digest = {"sha1": _text(fields.pop(b"sha1", b""))}
    else:
        raw = b"\0".join(_bytes(name) + b"\0" + _bytes(value) for name, value in fields.items())
        digest = {"sha256": hashlib.sha256(raw).hexdigest()}
        size = len(raw) if size is None else size
    kept = {"truncated": "1", "size": str(size or 0), **digest}
    for name, value in list(fields.items())[:8]:
        kept[f"prefix:{_text(name)[:64]}"] = _bytes(value)[:DEAD_LETTER_PREFIX_BYTES]
    return kept


def _entries(rows: list, streams: tuple[str, ...]) -> list[ReadEntry]:
    return [ReadEntry(streams[int(index) - 1], _text(entry_id), int(size), bool(truncated), _pairs(fields))
            for index, entry_id, size, truncated, fields in rows]


def _pairs(flat: list) -> dict:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _is_nogroup(reply) -> bool:
    return isinstance(reply, ResponseError) and "NOGROUP" in str(reply)


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
