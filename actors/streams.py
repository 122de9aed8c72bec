"""The replica's one Redis gateway: every command and script a replica sends goes through
``Streams`` (consumer groups, byte-bounded reading, leases, fenced finishing, refusals,
dead letters, cancel requests, model info). The job-hash scripts are clients/job_record.py's.
Every key it creates except the request streams gets a TTL. Everything read back from
Redis is producer-writable input: scripts coerce what they read, and a command that fails
for one job fails that job alone."""

import hashlib
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from conveyor.actors.messages import Delivery, ReadEntry
from conveyor.actors.partition_scripts import CLAIM_PARTITIONS_LUA, RELEASE_PARTITIONS_LUA
from conveyor.actors.resilience import retrying, transient
from conveyor.clients.events import Usage
from conveyor.clients.job_record import (
    FINISH_LUA,
    HAND_BACK_LUA,
    PROMPT_HEAD_CHARS,
    REJECT_LUA,
    START_LUA,
)
from conveyor.clients.job_record import Field as JobField
from conveyor.clients.keys import GROUP, PRIORITY_CLASSES, Keys
from conveyor.clients.model_info import ModelInfo, publish_model_info_async
from conveyor.clients.protocol import JobRequest
from conveyor.clients.redis_cluster import queue_script
from conveyor.clients.replica_records import queue_beat
from conveyor.clients.usage import USAGE_TTL_S, usage_day, usage_increments

DUPLICATE, CONFLICT = -1, -2
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_TTL_S = 7 * 86_400  # refreshed on every dead letter
DEAD_LETTER_PREFIX_BYTES = 256  # what a dead letter keeps of a payload it does not keep whole
REJECT_TTL_S = 3600
HAND_BACK_IDLE_MS = 10 * 365 * 86_400_000  # "idle forever": the next XAUTOCLAIM takes it


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
READ_LUA = (
    SHAPE_LUA
    + """
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
)

# The same shaping for entries claimed by id (reclaimed from a dead replica).
# KEYS: request stream. ARGV: max_bytes, prefix bytes, entry ids...
READ_IDS_LUA = (
    SHAPE_LUA
    + """
local out = {}
for i = 3, #ARGV do
  local rows = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if rows[1] then out[#out + 1] = shape(1, rows[1], tonumber(ARGV[1]), tonumber(ARGV[2])) end
end
return out
"""
)


RESUME_READ_PAGE = 1024  # out-stream entries one read of a resumed job's published events takes


class Streams:
    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str, model_name: str, max_entry_bytes: int):
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self.max_entry_bytes = max_entry_bytes
        self.model_name = model_name  # what usage counters name
        self.model_identity = ""  # what a job's attempt ran, on its record (actors/resume.py); set by the door
        # per read: groups of streams, each read by one script (so in one slot), in order
        self.read_groups = _read_groups(keys, model_name)
        self.request_streams = tuple(stream for group in self.read_groups for stream in group)
        self.first_partition = 0  # rotates: every partition is read first in turn
        self.finish_script = client.register_script(FINISH_LUA)
        self.start_script = client.register_script(START_LUA)
        self.reject_script = client.register_script(REJECT_LUA)
        self.hand_back_script = client.register_script(HAND_BACK_LUA)
        self.read_script = client.register_script(READ_LUA)
        self.read_ids_script = client.register_script(READ_IDS_LUA)
        self.claim_partitions_script = client.register_script(CLAIM_PARTITIONS_LUA)
        self.release_partitions_script = client.register_script(RELEASE_PARTITIONS_LUA)

    async def resilient(self, operation: Callable[[], Awaitable], what: str):
        """``operation`` retried through outages; recreates lost consumer groups."""
        return await retrying(operation, what, self.ensure_groups)

    async def write(self, queue_commands: Callable[[object], Awaitable[None]], what: str) -> list:
        """One pipelined round trip; what did not go through is sent again until it does.
        Returns each command's reply; a command that failed for its own sake (e.g. WRONGTYPE on
        a key a producer clobbered) leaves its ResponseError in the list instead of failing the
        others. A command its node could not serve then (CLUSTERDOWN or TRYAGAIN while a slot
        changes masters, a connection lost, NOGROUP: the groups are recreated first) is sent
        again, with the others that failed so and in the order they were queued, backing off
        like ``resilient``; a command that went through is never sent twice. (A node down
        fails all its commands of the step, so each key keeps its order; a slot being
        resharded may not: redis-py follows each redirected command on its own.)"""
        batch = _Batch(queue_commands)
        return await self.resilient(lambda: batch.send(self.redis), what)

    async def ensure_groups(self) -> None:
        for stream in self.request_streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read_new(self, count: int, byte_budget: int) -> list[ReadEntry]:
        """Up to ``count`` new entries and about ``byte_budget`` bytes, interactive first: every
        partition's interactive streams (the first one rotating, so all are served alike),
        then every partition's batch streams."""
        entries: list[ReadEntry] = []
        budget = byte_budget
        for group in self._groups_in_turn():
            if len(entries) >= count or budget <= 0:
                break
            args = [
                GROUP,
                self.consumer,
                count - len(entries),
                max(1, budget),
                self.max_entry_bytes,
                DEAD_LETTER_PREFIX_BYTES,
            ]
            rows = await self.resilient(lambda: self.read_script(keys=list(group), args=args), "read jobs")
            read = _entries(rows, group)
            budget -= sum(entry.bytes_read for entry in read)
            entries += read
        return entries

    async def read_partitions(
        self, partitions: list[int], count: int, byte_budget: int
    ) -> tuple[list[ReadEntry], set[int]]:
        """Up to ``count`` new entries and about ``byte_budget`` bytes from ``partitions`` (in
        that order), interactive first: one script for one partition (its streams share a
        slot), else each partition's interactive streams, then each one's batch streams.
        Also returns the partitions that may hold more: those that gave entries, and those
        the credits or bytes ran out before."""
        if len(partitions) == 1:
            passes = [[(partitions[0], self.partition_streams(partitions[0]))]]
        else:
            passes = [[(p, self._class_group(c, p)) for p in partitions] for c in range(len(PRIORITY_CLASSES))]
        entries: list[ReadEntry] = []
        budget, more, emptied = byte_budget, set(), set()
        for reads in passes:
            for partition, group in reads:
                if len(entries) >= count or budget <= 0:
                    more.add(partition)
                    continue
                read = await self._read_group(group, count - len(entries), budget)
                budget -= sum(entry.bytes_read for entry in read)
                entries += read
                (more if read else emptied).add(partition)
        return entries, more

    async def _read_group(self, group: tuple[str, ...], count: int, budget: int) -> list[ReadEntry]:
        args = [GROUP, self.consumer, count, max(1, budget), self.max_entry_bytes, DEAD_LETTER_PREFIX_BYTES]
        rows = await self.resilient(lambda: self.read_script(keys=list(group), args=args), "read jobs")
        return _entries(rows, group)

    def partition_streams(self, partition: int) -> tuple[str, ...]:
        """Every request stream of one partition, interactive first (one slot: one script)."""
        if not self.keys.partitioned:
            return self.read_groups[0]
        return tuple(s for c in range(len(PRIORITY_CLASSES)) for s in self._class_group(c, partition))

    def _class_group(self, class_index: int, partition: int) -> tuple[str, ...]:
        if not self.keys.partitioned:  # one group holds both classes: split it in half
            half = len(self.read_groups[0]) // 2
            return self.read_groups[0][class_index * half : (class_index + 1) * half]
        return self.read_groups[class_index * self.keys.partitions + partition]

    def _groups_in_turn(self) -> list[tuple[str, ...]]:
        partitions = self.keys.partitions
        if partitions == 1:
            return list(self.read_groups)
        first, self.first_partition = self.first_partition, (self.first_partition + 1) % partitions
        turn = [(first + i) % partitions for i in range(partitions)]
        by_class = [self.read_groups[c * partitions : (c + 1) * partitions] for c in range(len(PRIORITY_CLASSES))]
        return [groups[p] for groups in by_class for p in turn]

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

    async def start_attempt(
        self, job_id: str, entry_id: str, ttl: int, digest: str, job: JobRequest | None = None, new_trace: str = ""
    ) -> tuple[int, bool]:
        """Count this delivery on the job hash (with where it runs, its trace id and the prompt's
        head, for the dashboard: ``new_trace``, the id of the trace this replica starts unless
        the attempt continues the producer's); returns (attempt or DUPLICATE/CONFLICT, cancel
        requested). Raises ResponseError when the job's keys are unusable (e.g. not a hash)."""
        producer_trace = job.traceparent.split("-")[1] if job is not None and job.traceparent else ""
        args = [entry_id, ttl, repr(time.time()), digest, self.consumer, producer_trace, prompt_head(job), new_trace]
        args.append(self.model_identity)
        attempt, cancel = await self.resilient(
            lambda: self.start_script(keys=[self.keys.job(job_id), self.keys.out(job_id)], args=args),
            "start job",
        )
        return int(attempt), cancel == b"1"

    async def published(self, job_id: str, attempt: int, max_events: int) -> tuple[str | None, list[tuple]] | None:
        """For a job's new attempt: the model identity its previous attempt recorded and its
        out stream's entries (at most ``max_events``: None beyond, or when its keys are not
        what they should be: a producer's clobbering costs a rerun, never an error)."""
        field = JobField.MODEL_OF_ATTEMPT.format(attempt - 1)
        try:
            earlier = await self.resilient(lambda: self.redis.hget(self.keys.job(job_id), field), "read job record")
            entries, after = [], "-"
            while True:
                page = await self.resilient(
                    lambda: self.redis.xrange(self.keys.out(job_id), min=after, max="+", count=RESUME_READ_PAGE),
                    "read published events",
                )
                entries += page
                if len(page) < RESUME_READ_PAGE:
                    break
                if len(entries) >= max_events:
                    return None
                after = "(" + _text(page[-1][0])
        except ResponseError:
            return None
        return (None if earlier is None else _text(earlier)), entries

    async def note_resume(self, job_id: str, attempt: int, note: str) -> None:
        field = JobField.RESUME_OF_ATTEMPT.format(attempt)
        await self.resilient(lambda: self.redis.hset(self.keys.job(job_id), field, note[:500]), "note resume")

    async def queue_finish(
        self, pipe, delivery: Delivery, status: str, event: dict[str, bytes], usage: Usage | None = None
    ) -> None:
        """``usage``: a done job's, added to the day's counters when it finishes the first time."""
        now = time.time()
        keys = [self.keys.job(delivery.job_id), self.keys.out(delivery.job_id), delivery.stream]
        args = [delivery.attempt, status, event["type"], event["data"], delivery.result_ttl, GROUP]
        args += [delivery.entry_id, repr(now)]
        if usage is not None:
            keys.append(self.keys.usage_of(delivery.job_id, usage_day(now)))
            args.append(USAGE_TTL_S)
            args += usage_increments(self.model_name, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        await queue_script(self.finish_script, keys, args, pipe)

    async def queue_reject(self, pipe, job_id: str, entry_id: str, event_data: bytes) -> None:
        await queue_script(
            self.reject_script,
            [self.keys.job(job_id), self.keys.out(job_id)],
            [entry_id, event_data, REJECT_TTL_S, repr(time.time())],
            pipe,
        )

    def queue_token_event(self, pipe, delivery: Delivery, event: dict[str, bytes]) -> None:
        pipe.xadd(self.keys.out(delivery.job_id), event)
        pipe.expire(self.keys.out(delivery.job_id), delivery.result_ttl)

    async def drop_entry(self, stream: str, entry_id: str) -> None:
        """Ack and delete an entry that needs no answer (a duplicate of a known job)."""

        async def queue(pipe):
            pipe.xack(stream, GROUP, entry_id)
            pipe.xdel(stream, entry_id)

        await self.write(queue, "drop duplicate")

    def queue_dead_letter(
        self,
        pipe,
        stream: str,
        entry_id: str,
        reason: str,
        fields: dict | None,
        *,
        keep_payload: bool = False,
        job_id: str | None = None,
        size: int | None = None,
        stub: bool = False,
    ) -> None:
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

    # ---- leases (the ledger) ----------------------------------------------------------
    async def renew(self, ids_by_stream: dict[str, list[str]]) -> None:
        """Reset the idle time of entries we hold (XCLAIM of our own ids, JUSTID)."""
        for stream, ids in ids_by_stream.items():
            await self.resilient(
                lambda: self.redis.xclaim(stream, GROUP, self.consumer, 0, ids, justid=True), "renew leases"
            )

    async def claim_idle(self, stream: str, min_idle_ms: int, count: int) -> list[str]:
        """Ids of entries idle longer than ``min_idle_ms`` (their owner died), now ours.
        (Entries deleted while pending leave the pending list with this call: Redis >= 7.)"""
        claimed = await self.resilient(
            lambda: self.redis.xautoclaim(
                stream, GROUP, self.consumer, min_idle_ms, start_id="0-0", count=count, justid=True
            ),
            "reclaim",
        )
        return [_text(entry_id) for entry_id in claimed]

    async def pending_ids(self, stream: str) -> list[str]:
        """The server's pending list of this consumer on ``stream``."""
        rows = await self.resilient(
            lambda: self.redis.xpending_range(
                stream, GROUP, min="-", max="+", count=100_000, consumername=self.consumer
            ),
            "list pending",
        )
        return [_text(row["message_id"]) for row in rows]

    async def hand_back(self, ids_by_stream: dict[str, list[str]], running: list[Delivery]) -> None:
        """Make these entries claimable by any replica now; their running jobs queued again."""

        async def queue(pipe):
            for stream, ids in ids_by_stream.items():
                pipe.xclaim(stream, GROUP, self.consumer, 0, ids, idle=HAND_BACK_IDLE_MS, justid=True)
            for delivery in running:
                await queue_script(
                    self.hand_back_script,
                    [self.keys.job(delivery.job_id)],
                    [delivery.attempt, delivery.entry_id, repr(time.time())],
                    pipe,
                )

        await self.write(queue, "hand back")

    # ---- partitions (the partition keeper) ------------------------------------------------
    async def claim_partitions(self, lease_ms: int) -> list[int]:
        """Renew this replica's partition leases and take its fair share; the partitions it owns."""
        keys, args = (
            [self.keys.partition_owners, self.keys.partition_takers],
            [self.consumer, lease_ms, self.keys.partitions],
        )
        owned = await self.resilient(lambda: self.claim_partitions_script(keys=keys, args=args), "claim partitions")
        return [int(p) for p in owned if 0 <= int(p) < self.keys.partitions]

    async def release_partitions(self) -> None:
        keys, args = [self.keys.partition_owners, self.keys.partition_takers], [self.consumer, 0, self.keys.partitions]
        await self.resilient(lambda: self.release_partitions_script(keys=keys, args=args), "release partitions")

    @asynccontextmanager
    async def wake_messages(self) -> AsyncIterator:
        """A pub/sub connection for the wake channels (named like the request streams)."""
        async with self.redis.pubsub() as pubsub:
            yield pubsub

    # ---- cancels (the cancel watcher) ---------------------------------------------------
    @asynccontextmanager
    async def cancel_messages(self) -> AsyncIterator[AsyncIterator[dict]]:
        """The ``<ns>:cancel`` channel's messages while the block runs (producer input)."""
        async with self.redis.pubsub() as pubsub:
            await pubsub.subscribe(self.keys.cancel)
            yield pubsub.listen()

    async def cancel_flags(self, job_ids: list[str]) -> list[bool]:
        """Whether each job's hash has its cancel flag set (a clobbered hash: not set)."""

        async def queue(pipe):
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), "cancel")

        return [flag == b"1" for flag in await self.write(queue, "poll cancel flags")]

    # ---- model info (the announcer) -----------------------------------------------------
    async def publish_model_info(self, info: ModelInfo, ttl_s: int) -> None:
        await self.resilient(
            lambda: publish_model_info_async(self.redis, self.keys, info, ttl_s=ttl_s), "publish model info"
        )

    async def publish_limits(self, limits: dict, ttl_s: int) -> None:
        """One copy per partition: the submit script reads the one in its job's slot."""

        async def queue(pipe):
            for key in self.keys.all_limits:
                pipe.hset(key, mapping=limits)
                pipe.expire(key, ttl_s)

        await self.write(queue, "publish limits")

    async def publish_replica_record(self, fields: dict[str, str], now: float) -> None:
        """This replica's record for operators (clients/replica_records.py): one round trip."""

        async def queue(pipe):
            queue_beat(pipe, self.keys, self.consumer, fields, now)

        await self.write(queue, "publish the replica record")

    async def close(self) -> None:
        await self.redis.aclose()


class _Batch:
    """The commands of one ``Streams.write`` and what came of each: queued once (their args
    recorded as they are queued), then only those still to go through are sent again, on a
    plain pipeline or a cluster one alike."""

    def __init__(self, queue_commands: Callable[[object], Awaitable[None]]):
        self.queue_commands = queue_commands
        self.commands: list[tuple[tuple, dict]] | None = None  # (args, options) of each, in order
        self.scripts: set = set()  # the scripts a plain pipeline loads before it sends EVALSHA
        self.replies: list = []
        self.pending: list[int] = []  # the commands still to go through, in order

    async def send(self, client) -> list:
        """Send what is pending; raises what ``retrying`` waits out while some is."""
        async with client.pipeline(transaction=False) as pipe:
            if self.commands is None:
                await self._queue_first(pipe)
            else:
                for index in self.pending:
                    args, options = self.commands[index]
                    pipe.execute_command(*args, **options)
                if self.scripts:
                    pipe.scripts.update(self.scripts)
            queued = _queued_commands(pipe)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except Exception as exc:
                if transient(exc) and queued is not None:  # keep what the nodes it reached answered
                    self._record([_answer_of(command, exc) for command in queued])
                raise
        self._record(replies)
        if self.pending:
            failed = [self.replies[i] for i in self.pending]
            # NOGROUP first: retrying recreates the groups before it sends the rest again
            raise next((r for r in failed if _is_nogroup(r)), failed[0]).with_traceback(None)
        return self.replies

    async def _queue_first(self, pipe) -> None:
        commands: list[tuple[tuple, dict]] = []
        queue = pipe.execute_command

        def recording(*args, **options):
            commands.append((args, dict(options)))
            return queue(*args, **options)

        pipe.execute_command = recording  # every queued command goes through it (pipe.xadd, scripts...)
        try:
            await self.queue_commands(pipe)
        finally:
            del pipe.execute_command
        if len(commands) != len(pipe):
            raise RuntimeError(f"{len(pipe) - len(commands)} command(s) queued without execute_command")
        self.commands = commands
        self.scripts = set(getattr(pipe, "scripts", ()))
        self.replies = [None] * len(commands)
        self.pending = list(range(len(commands)))

    def _record(self, replies: list) -> None:
        """Keep the replies to the pending commands; those to send again stay pending."""
        if len(replies) != len(self.pending):
            raise RuntimeError(f"a pipeline of {len(self.pending)} commands gave {len(replies)} replies")
        for index, reply in zip(self.pending, replies):
            self.replies[index] = reply
        self.pending = [i for i in self.pending if _again(self.replies[i])]


def _again(reply) -> bool:
    """Whether a reply is a failure the command may get past when sent again."""
    return isinstance(reply, BaseException) and (transient(reply) or _is_nogroup(reply))


try:  # what a cluster pipeline's command holds until a node answers it (redis-py that keeps
    # the answers across its own retries; redis.cluster._UNANSWERED)
    from redis.cluster import _UNANSWERED
except ImportError:  # others: an unanswered command cannot be told from a None reply
    _UNANSWERED = None


def _queued_commands(pipe) -> list | None:
    """A cluster pipeline's queued commands: when it raises (a node it could not reach), each
    one a node answered holds its reply, so only the others are sent again. None where that
    cannot be told (a plain pipeline: one connection, all or nothing)."""
    strategy = getattr(pipe, "_execution_strategy", None)
    queued = getattr(strategy, "_command_queue", None)
    if _UNANSWERED is None or not isinstance(queued, list):
        return None
    return list(queued)


def _answer_of(command, error: BaseException):
    """A cluster pipeline command's reply, or ``error`` where no node answered it."""
    result = getattr(command, "result", _UNANSWERED)
    return error if result is _UNANSWERED else result


def _read_groups(keys: Keys, model_name: str) -> tuple[tuple[str, ...], ...]:
    """The request streams this replica reads, grouped by what one read script may touch:
    on a single server one group (the default streams and this model's own, interactive
    first); partitioned, one group per class and partition (each one slot), class-major."""
    if not keys.partitioned:
        return (
            (
                keys.interactive,
                keys.model_requests(model_name, "interactive"),
                keys.batch,
                keys.model_requests(model_name, "batch"),
            ),
        )
    return tuple(
        (keys.requests(c, p), keys.model_requests(model_name, c, p))
        for c in PRIORITY_CLASSES
        for p in range(keys.partitions)
    )


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
    return [
        ReadEntry(streams[int(index) - 1], _text(entry_id), int(size), bool(truncated), _pairs(fields))
        for index, entry_id, size, truncated, fields in rows
    ]


def _pairs(flat: list) -> dict:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _is_nogroup(reply) -> bool:
    return isinstance(reply, ResponseError) and "NOGROUP" in str(reply)


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def prompt_head(job: JobRequest | None) -> str:
    """What the dashboard shows of a job's prompt: its first PROMPT_HEAD_CHARS characters (a
    chat's last message; token ids only counted)."""
    if job is None:
        return ""
    if job.prompt is not None:
        return job.prompt[:PROMPT_HEAD_CHARS]
    if job.messages is not None:
        content = job.chat_messages()[-1].get("content")
        return (content if isinstance(content, str) else str(content))[:PROMPT_HEAD_CHARS]
    return f"<{len(job.prompt_token_ids or ())} prompt token ids>"
