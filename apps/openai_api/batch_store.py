"""Files and batches of the Batch API, kept in Redis under a tenant's namespace.

Key layout (`ns` = the tenant's namespace):

| key | type | content | TTL |
|---|---|---|---|
| `<ns>:file:<id>` | hash | file object: filename, purpose, bytes, lines, created_at, expires_at | FILE_TTL_S (input), BATCH_TTL_S (outputs) |
| `<ns>:file:<id>:content` | string | the file's bytes | as its hash |
| `<ns>:files` | sorted set | file ids by creation time (ms): listing | BATCH_TTL_S, refreshed by each file |
| `<ns>:batch:<id>` | hash | batch object: status, timestamps, counts, usage, errors, file ids; for `conveyor batch` also `model_override` and `job_key` (what job ids hash instead of the batch id) | BATCH_TTL_S from creation |
| `<ns>:batch:<id>:results` | hash | line index -> `+` or `-` and the output line (JSON) | BATCH_TTL_S, deleted when assembled |
| `<ns>:batch:<id>:lease` | string | owner of the runner driving the batch | LEASE (SET NX PX, renewed) |
| `<ns>:batches` | sorted set | batch ids by creation time (ms): listing | BATCH_TTL_S, refreshed by each create |
| `<ns>:batches:active` | set | ids of batches not yet finished: what runners look for | as above |

This module is the one owner of that state: the routes and the runner only call it.
Status changes are compare-and-set scripts, so a cancel and a runner never overwrite
each other, and a result line is stored once (HSETNX) however many runners record it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from typing import Any

from conveyor.clients.limits import MAX_JSON_BYTES
from conveyor.clients.redis_cluster import is_cluster, queue_script
from conveyor.clients.webhook_queue import MAX_PENDING_EVENTS, event_args

FILE_TTL_S = 7 * 86_400  # uploaded files
BATCH_TTL_S = 30 * 86_400  # batches, their results and output files
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_UPLOAD_BYTES = MAX_FILE_BYTES + 1024 * 1024  # a whole upload: the file, multipart framing, `purpose`
MAX_FILE_LINES = 50_000
MAX_LINE_BYTES = MAX_JSON_BYTES  # a line is at most what the protocol takes as one JSON job
COMPLETION_WINDOWS = {"24h": 86_400}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ANY_ENDPOINT = "*"  # `conveyor batch`: each line names its own (as `vllm run-batch` allows)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_ERRORS = 100  # validation errors kept on a failed batch
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,96}")
MAX_ACTIVE_SCANNED = 1000  # active batch ids a runner looks at per scan
MAX_FILES_SCANNED, FILES_PAGE = 10_000, 200  # file ids one listing reads at most, and per round trip

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
CANCELLABLE = ("validating", "in_progress")
OK, FAILED = b"+", b"-"  # prefixes of stored result lines

# Compare-and-set a batch's status. KEYS: batch hash, active set, and the namespace's webhook
# events stream when it has a webhook. ARGV: allowed current statuses (comma-separated), new
# status, "1" when terminal, batch id, the number E of event fields (0: no event), the stream's
# bound, the E event fields (field, value, ...), then field/value pairs to set with the status.
# A terminal change queues the `batch.<status>` event in the same script: exactly once per
# batch (a stream of the wrong type loses the event, never the change). Returns {1, new}
# when changed, {0, current} when not.
TRANSITION_LUA = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {0, ''} end
if not string.find(',' .. ARGV[1] .. ',', ',' .. current .. ',', 1, true) then return {0, current} end
local events = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 7 + events, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' then
  redis.call('SREM', KEYS[2], ARGV[4])
  if events > 0 and KEYS[3] then
    redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', unpack(ARGV, 7, 6 + events))
  end
end
return {1, ARGV[2]}
"""

# Store one finished request's output line, once. KEYS: batch hash, results hash.
# ARGV: line index, value (prefix + line), counter (completed|failed), prompt tokens,
# completion tokens, ttl. Only while the batch runs (in_progress or cancelling).
RECORD_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[5])
return 1
"""

# Create a batch unless its id exists. KEYS: batch hash, listing zset, active set.
# ARGV: id, created ms, ttl, listing cutoff ms (older ids are dropped from the listing),
# then field/value pairs. Returns 1 created, 0 existed.
CREATE_BATCH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""

# Delete a file unless a batch that is not finished reads it. KEYS: file hash, content,
# listing zset, active set. ARGV: file id, batch key prefix, terminal statuses (comma-
# separated). Returns {1, ''} deleted, {0, ''} no such file, {-1, batch id} in use.
DELETE_FILE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
for _, batch_id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local batch = redis.call('HMGET', ARGV[2] .. batch_id, 'status', 'input_file_id')
  if batch[1] and batch[2] == ARGV[1] and not string.find(',' .. ARGV[3] .. ',', ',' .. batch[1] .. ',', 1, true) then
    return {-1, batch_id}
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return {1, ''}
"""

RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchKeys:
    """Key names of the Batch API in one namespace (see the module docstring). `tagged`
    (cluster mode): all of them under the namespace's hash tag `{<ns>}`, one slot, so its
    scripts and MULTIs (a batch with its list and results, a file with its content) may run."""

    def __init__(self, ns: str, tagged: bool = False) -> None:
        self.ns = ns
        self.prefix = f"{ns}:{{{ns}}}" if tagged else ns

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def file_content(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}:content"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def results(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:results"

    def lease(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:lease"

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def active(self) -> str:
        return f"{self.prefix}:batches:active"


class FileInUse(Exception):
    """A file that a batch which has not finished reads: not deleted."""

    def __init__(self, file_id: str, batch_id: str) -> None:
        super().__init__(
            f"file {file_id} is the input of batch {batch_id}, which has not finished: cancel it or wait for it to end"
        )
        self.batch_id = batch_id


class FileTooLarge(ValueError):
    """An upload over MAX_FILE_BYTES, MAX_FILE_LINES or MAX_LINE_BYTES (the message says which)."""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def derived_file_id(batch_id: str, kind: str) -> str:
    """The output or error file of a batch: one id, so a second assembly rewrites the same file."""
    return f"file-{hashlib.sha256(f'{batch_id}:{kind}'.encode()).hexdigest()[:24]}"


def valid_id(value: str) -> bool:
    """Ids go into key names: only ids of our own alphabet are looked up."""
    return bool(ID_PATTERN.fullmatch(value))


def check_jsonl(content: bytes) -> int:
    """Number of non-empty lines; FileTooLarge over a limit, ValueError when not UTF-8."""
    if len(content) > MAX_FILE_BYTES:
        raise FileTooLarge(f"file is {len(content)} bytes, over the limit of {MAX_FILE_BYTES} bytes")
    lines = 0
    for number, line in enumerate(content.split(b"\n"), 1):
        if len(line) > MAX_LINE_BYTES:
            raise FileTooLarge(f"line {number} is {len(line)} bytes, over the limit of {MAX_LINE_BYTES} bytes")
        lines += bool(line.strip())
    if lines > MAX_FILE_LINES:
        raise FileTooLarge(f"file has {lines} requests, over the limit of {MAX_FILE_LINES}")
    content.decode("utf-8")  # UnicodeDecodeError is a ValueError
    return lines


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's rule: at most 16 string pairs, keys <= 64 and values <= 512 characters."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata must be an object of at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ValueError(
                f"metadata[{key[:64]!r}]: keys are strings of at most {MAX_METADATA_KEY} "
                f"characters, values strings of at most {MAX_METADATA_VALUE}"
            )
    return dict(metadata)


class BatchStore:
    """Files and batches of one namespace on a redis.asyncio client (bytes responses)."""

    def __init__(self, redis: Any, ns: str, events_stream: str | None = None) -> None:
        """`events_stream`: the namespace's webhook events stream (Keys.webhooks), when it has a
        webhook: each batch's terminal status then queues its `batch.*` event there."""
        self.redis = redis
        self.keys = BatchKeys(ns, tagged=is_cluster(redis))
        self.events_stream = events_stream
        self._transition = redis.register_script(TRANSITION_LUA)
        self._record = redis.register_script(RECORD_LUA)
        self._create_batch = redis.register_script(CREATE_BATCH_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._delete_file = redis.register_script(DELETE_FILE_LUA)

    # ---------------------------------------------------------------- files

    async def put_file(
        self,
        content: bytes,
        *,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        ttl_s: int = FILE_TTL_S,
        lines: int | None = None,
    ) -> dict[str, Any]:
        """Store a file (content first, then its object) and return its OpenAI file object."""
        file_id = file_id or new_file_id()
        now = int(time.time())
        fields = {
            "id": file_id,
            "filename": filename,
            "purpose": purpose,
            "bytes": len(content),
            "lines": content.count(b"\n") if lines is None else lines,
            "created_at": now,
            "expires_at": now + ttl_s,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.file_content(file_id), content, ex=ttl_s)
            pipe.delete(self.keys.file(file_id))
            pipe.hset(self.keys.file(file_id), mapping={k: str(v) for k, v in fields.items()})
            pipe.expire(self.keys.file(file_id), ttl_s)
            created_ms = time.time_ns() // 1_000_000  # the listing's order (created_at has seconds)
            pipe.zadd(self.keys.files, {file_id: created_ms})
            pipe.zremrangebyscore(self.keys.files, "-inf", f"({created_ms - BATCH_TTL_S * 1000}")  # none lives longer
            pipe.expire(self.keys.files, BATCH_TTL_S)
            await pipe.execute()
        return file_object(fields)

    async def list_files(
        self, limit: int, after: str | None, order: str = "desc", purpose: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Files by creation time (`order` desc: newest first), `limit` of them after the file
        `after`, only `purpose`'s when given: (objects, has_more). Reads at most
        MAX_FILES_SCANNED ids; expired files leave the listing as they are met."""
        start = 0
        if after:
            rank = await self._file_rank(after, order)
            if rank is None:
                return [], False
            start = rank + 1
        found: list[dict[str, Any]] = []
        while len(found) <= limit and start < MAX_FILES_SCANNED:
            ids = await self._file_ids(start, FILES_PAGE, order)
            found += await self._file_objects(ids, purpose)
            start += FILES_PAGE
            if len(ids) < FILES_PAGE:
                break
        return found[:limit], len(found) > limit

    async def _file_rank(self, file_id: str, order: str) -> int | None:
        if not valid_id(file_id):
            return None
        rank = self.redis.zrevrank if order == "desc" else self.redis.zrank
        return await rank(self.keys.files, file_id)

    async def _file_ids(self, start: int, count: int, order: str) -> list[str]:
        read = self.redis.zrevrange if order == "desc" else self.redis.zrange
        return [i.decode("ascii", "replace") for i in await read(self.keys.files, start, start + count - 1)]

    async def _file_objects(self, ids: list[str], purpose: str | None) -> list[dict[str, Any]]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(self.keys.file(file_id))
        objects, gone = [], []
        for file_id, fields in zip(ids, await pipe.execute()):
            if not fields:
                gone.append(file_id)
            elif purpose is None or _text_fields(fields).get("purpose") == purpose:
                objects.append(file_object(_text_fields(fields)))
        if gone:
            await self.redis.zrem(self.keys.files, *gone)
        return objects

    async def delete_file(self, file_id: str) -> bool:
        """Delete a file (False: there is none); FileInUse while a batch that has not finished reads it."""
        if not valid_id(file_id):
            return False
        keys = [self.keys.file(file_id), self.keys.file_content(file_id), self.keys.files, self.keys.active]
        code, batch_id = await self._delete_file(keys, [file_id, self.keys.batch(""), ",".join(TERMINAL)])
        if code == -1:
            raise FileInUse(file_id, batch_id.decode() if isinstance(batch_id, bytes) else batch_id)
        return code == 1

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not valid_id(file_id):
            return None
        fields = await self.redis.hgetall(self.keys.file(file_id))
        return file_object(_text_fields(fields)) if fields else None

    async def file_content(self, file_id: str) -> bytes | None:
        return await self.redis.get(self.keys.file_content(file_id)) if valid_id(file_id) else None

    # ---------------------------------------------------------------- batches

    async def create_batch(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str],
        batch_id: str | None = None,
        **extra: str,
    ) -> tuple[dict[str, Any], bool]:
        """Create a batch in `validating` (or find the one with `batch_id`): (object, created).
        `extra` fields are kept for the runner (e.g. `model_override` of `conveyor batch`)."""
        batch_id = batch_id or new_batch_id()
        now = time.time()
        fields = {
            "id": batch_id,
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            "metadata": json.dumps(metadata),
            "status": "validating",
            "created_at": int(now),
            "expires_at": int(now) + COMPLETION_WINDOWS[completion_window],
            **extra,
        }
        created_ms = int(now * 1000)
        args = [batch_id, created_ms, BATCH_TTL_S, created_ms - BATCH_TTL_S * 1000, *_flat(fields)]
        created = await self._create_batch([self.keys.batch(batch_id), self.keys.batches, self.keys.active], args)
        return await self.get_batch(batch_id), bool(created)

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        fields = await self.batch_fields(batch_id)
        return batch_object(fields) if fields else None

    async def batch_fields(self, batch_id: str) -> dict[str, str]:
        """The batch hash as text (empty when there is none)."""
        if not valid_id(batch_id):
            return {}
        return _text_fields(await self.redis.hgetall(self.keys.batch(batch_id)))

    async def list_batches(self, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, `limit` of them after the batch `after`: (objects, has_more)."""
        start = 0
        if after:
            rank = await self.redis.zrevrank(self.keys.batches, after) if valid_id(after) else None
            if rank is None:
                return [], False
            start = rank + 1
        ids = [i.decode() for i in await self.redis.zrevrange(self.keys.batches, start, start + limit)]
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids[:limit]:
            pipe.hgetall(self.keys.batch(batch_id))
        found = [batch_object(_text_fields(f)) for f in await pipe.execute() if f]
        return found, len(ids) > limit

    async def transition(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields: Any) -> tuple[bool, str]:
        """Set `status` (and `fields`) if the current status is in `allowed`: (changed, status now)."""
        terminal = "1" if status in TERMINAL else "0"
        keys = [self.keys.batch(batch_id), self.keys.active]
        event = []
        if terminal == "1" and self.events_stream:
            keys.append(self.events_stream)
            event = event_args(f"batch.{status}", batch_id)
        args = [",".join(allowed), status, terminal, batch_id, len(event), MAX_PENDING_EVENTS, *event, *_flat(fields)]
        changed, now = await self._transition(keys, args)
        return bool(changed), now.decode() if isinstance(now, bytes) else now

    async def request_cancel(self, batch_id: str) -> tuple[bool, str]:
        """validating/in_progress -> cancelling; the runner then winds the batch down."""
        return await self.transition(batch_id, CANCELLABLE, "cancelling", cancelling_at=int(time.time()))

    async def active_batch_ids(self) -> list[str]:
        """A bounded sample of the active set (producers of the namespace can write it): ids
        that are not ours (junk bytes, other alphabets) are skipped, never decoded into keys."""
        members = await self.redis.srandmember(self.keys.active, MAX_ACTIVE_SCANNED)
        ours = {m: m.decode("ascii", "replace") for m in members}
        junk = [m for m, text in ours.items() if not valid_id(text)]
        if junk:  # no batch can ever have such an id: forget it, so it cannot crowd out real ones
            await self.redis.srem(self.keys.active, *junk)
        return sorted(text for text in ours.values() if valid_id(text))

    async def statuses(self, batch_ids: list[str]) -> list[str | None]:
        """The status of each batch (None: no such batch)."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hget(self.keys.batch(batch_id), "status")
        replies = await pipe.execute(raise_on_error=False) if batch_ids else []  # a producer's junk: not a hash
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else None for v in replies]

    async def forget_active(self, batch_id: str) -> None:
        """A batch whose hash is gone (expired) is no runner's business any more."""
        await self.redis.srem(self.keys.active, batch_id)

    # ---------------------------------------------------------------- results

    async def queue_record(
        self, pipe: Any, batch_id: str, index: int, line: dict[str, Any], ok: bool, usage: tuple[int, int] = (0, 0)
    ) -> None:
        """Queue the store of one output line on `pipe` (stored once; counted once)."""
        value = (OK if ok else FAILED) + json.dumps(line, separators=(",", ":")).encode()
        args = [index, value, "completed" if ok else "failed", usage[0], usage[1], BATCH_TTL_S]
        await queue_script(self._record, [self.keys.batch(batch_id), self.keys.results(batch_id)], args, pipe)

    async def recorded_indexes(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self.redis.hkeys(self.keys.results(batch_id))}

    async def results(self, batch_id: str, indexes: list[int], chunk: int = 1000) -> dict[int, bytes]:
        """Stored lines (prefix + JSON) of `indexes`, read in chunks."""
        found: dict[int, bytes] = {}
        for start in range(0, len(indexes), chunk):
            part = indexes[start : start + chunk]
            values = await self.redis.hmget(self.keys.results(batch_id), part)
            found.update((i, v) for i, v in zip(part, values) if v is not None)
        return found

    async def drop_results(self, batch_id: str) -> None:
        await self.redis.delete(self.keys.results(batch_id))

    # ---------------------------------------------------------------- leases

    async def claim(self, batch_id: str, owner: str, lease_ms: int) -> bool:
        return bool(await self.redis.set(self.keys.lease(batch_id), owner, nx=True, px=lease_ms))

    async def renew(self, batch_id: str, owner: str, lease_ms: int) -> bool:
        return bool(await self._renew([self.keys.lease(batch_id)], [owner, lease_ms]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._release([self.keys.lease(batch_id)], [owner])

    async def lease_left_ms(self, batch_id: str) -> int:
        """Milliseconds the current lease has left (<= 0: nobody holds it)."""
        return int(await self.redis.pttl(self.keys.lease(batch_id)))


# ---------------------------------------------------------------- OpenAI objects


def file_object(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": fields["id"],
        "object": "file",
        "bytes": int(fields["bytes"]),
        "created_at": int(fields["created_at"]),
        "expires_at": int(fields["expires_at"]),
        "filename": fields["filename"],
        "purpose": fields["purpose"],
        "status": "processed",
        "status_details": None,
    }


TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def batch_object(fields: dict[str, str]) -> dict[str, Any]:
    """The OpenAI batch object of a batch hash (fields as text)."""

    def number(name: str) -> int:
        return int(fields.get(name) or 0)

    errors = json.loads(fields["errors"]) if fields.get("errors") else None
    return {
        "id": fields["id"],
        "object": "batch",
        "endpoint": fields["endpoint"],
        "errors": errors,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": fields["status"],
        "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        "created_at": number("created_at"),
        **{name: (number(name) if fields.get(name) else None) for name in ("expires_at", *TIMESTAMPS)},
        "request_counts": {"total": number("total"), "completed": number("completed"), "failed": number("failed")},
        "usage": usage_object(number("input_tokens"), number("output_tokens")),
        "metadata": json.loads(fields.get("metadata") or "{}") or None,
        "model": fields.get("model") or None,
    }


def usage_object(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _text_fields(fields: dict) -> dict[str, str]:
    return {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()}


def _flat(fields: dict[str, Any]) -> list[str]:
    return [str(item) for pair in fields.items() for item in pair]
