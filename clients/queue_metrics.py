"""Queue facts an operator or an autoscaler reads, with a bounded number of Redis commands
whatever the queue holds: per request stream (class, partition, model) its length, the
`engines` group's pending entries (delivered, not yet acked: in flight) and lag (not yet
delivered: waiting), the age of the oldest waiting entry, the nearest deadline among the
oldest waiting jobs, the consumers; the dead letters; the replicas' own records
(clients/replica_records.py).

One read of a namespace costs one SRANDMEMBER (the published models, at most MAX_MODELS),
then one pipelined round trip: one script per partition (TIME, then per stream XLEN, XINFO
GROUPS and, when something waits, one to four XRANGE ... COUNT DEADLINE_SCAN_PAGE whose entries
never leave the server), XLEN of the dead letters, and the replica records' script
(ZREVRANGE, one HMGET per replica). So 100,000 queued jobs cost what 1 does
(tests/test_dashboard.py counts them; tests/test_deadline_gauge.py bounds the deadline scan).
Everything read is input: wrong types read as empty, numbers are checked, and a payload the
script cannot decode is skipped, never an error.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from conveyor.clients.keys import GROUP, PRIORITY_CLASSES, Keys
from conveyor.clients.limits import EARLIEST_DEADLINE
from conveyor.clients.redis_cluster import is_cluster
from conveyor.clients.replica_records import READ_REPLICAS_LUA, ReplicaRecord, read_args, records_from

MAX_MODELS = 64  # model names read from <ns>:models per look
# The deadline gauge looks at the oldest waiting entries of each stream only, so a read costs
# the same with 300 or 300,000 jobs queued: the nearest deadline among these many of them...
DEADLINE_SCAN_ENTRIES = 256
# ...read this many at a time (at most 4 XRANGE per stream)...
DEADLINE_SCAN_PAGE = 64
# ...until their payloads reach this many bytes: a queue of long documents is not copied 256
# at a time. An entry is decoded while its payload fits in what is left of these bytes, so a
# huge one is skipped, not the smaller ones after it.
DEADLINE_SCAN_BYTES = 512 * 1024
# Deadlines outside these bounds (epoch seconds) count as none: below, the replica rejects the
# job (EARLIEST_DEADLINE: a relative time by mistake); above (year 5138), it is no deadline in
# practice, and the milliseconds the script returns stay well inside a 64-bit integer.
LATEST_DEADLINE = 1e11

# KEYS: request streams of one slot. ARGV: the group, DEADLINE_SCAN_ENTRIES, DEADLINE_SCAN_PAGE,
# DEADLINE_SCAN_BYTES, EARLIEST_DEADLINE, LATEST_DEADLINE. Returns the server time (ms), then
# per stream {length, pending, lag, entries_read, oldest waiting age ms, consumers, ms until
# the nearest deadline of a waiting job (false: none)}; -1: unknown.
QUEUE_FACTS_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local scan_entries, scan_page, scan_bytes = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local earliest, latest = tonumber(ARGV[5]), tonumber(ARGV[6])
local out = {now_ms}
-- The job's payload and its decoder: `data` (msgpack) or `json`, as clients/safe_payload.py reads.
local function payload_of(fields)
  local json
  for j = 1, #fields - 1, 2 do
    if fields[j] == 'data' then return fields[j + 1], cmsgpack.unpack_one end
    if fields[j] == 'json' then json = fields[j + 1] end
  end
  return json, json and cjson.decode
end
-- The job's deadline (epoch s) when the payload is a map holding a plausible one. Producer
-- input: junk, a list, a string, NaN or inf, nesting too deep to decode (an error that pcall
-- catches) all read as none. unpack_one decodes the first msgpack value only.
local function deadline_in(payload, decode)
  local ok, first, second = pcall(decode, payload)
  local job = decode == cjson.decode and first or second
  if not ok or type(job) ~= 'table' then return nil end
  local deadline = rawget(job, 'deadline')
  if type(deadline) == 'number' and deadline >= earliest and deadline <= latest then return deadline end
end
-- The oldest waiting entry's age (ms), and ms until the nearest deadline (false: none) among
-- the scan_entries oldest waiting entries, read a page at a time until their payloads reach
-- scan_bytes; an entry is decoded while its payload fits in what is left of scan_bytes.
local function waiting_after(stream, start)
  local age_ms, nearest, read, read_bytes, decode_left = -1, nil, 0, 0, scan_bytes
  while read < scan_entries and read_bytes < scan_bytes do
    local rows = redis.call('XRANGE', stream, start, '+', 'COUNT', math.min(scan_page, scan_entries - read))
    if not rows[1] then break end
    if age_ms < 0 then age_ms = now_ms - tonumber(string.match(rows[1][1], '^(%d+)')) end
    for _, row in ipairs(rows) do
      local payload, decode = payload_of(row[2])
      local size = type(payload) == 'string' and #payload or 0
      read_bytes = read_bytes + size
      if size > 0 and size <= decode_left then
        decode_left = decode_left - size
        local deadline = deadline_in(payload, decode)
        if deadline and (nearest == nil or deadline < nearest) then nearest = deadline end
      end
    end
    read = read + #rows
    start = '(' .. rows[#rows][1]
    if #rows < scan_page then break end
  end
  return age_ms, nearest ~= nil and math.floor(nearest * 1000) - now_ms
end
for _, stream in ipairs(KEYS) do
  local row = {0, 0, -1, -1, -1, 0, false}
  local length = redis.pcall('XLEN', stream)
  local groups = type(length) == 'number' and redis.pcall('XINFO', 'GROUPS', stream) or {err = 'no stream'}
  if type(length) == 'number' then
    row[1] = length
    local found = false
    for _, g in ipairs(groups.err and {} or groups) do
      local info = {}
      for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
      if info['name'] == ARGV[1] then
        found = true
        row[2], row[6] = tonumber(info['pending']) or 0, tonumber(info['consumers']) or 0
        row[3], row[4] = tonumber(info['lag']) or -1, tonumber(info['entries-read']) or -1
        -- a group that never read has no entries-read: it has read none (the rate counts from 0)
        if row[4] < 0 and info['last-delivered-id'] == '0-0' then row[4] = 0 end
        local waiting = row[3] >= 0 and row[3] or length - row[2]
        if waiting > 0 then row[5], row[7] = waiting_after(stream, '(' .. info['last-delivered-id']) end
      end
    end
    if not found then row[4] = 0 end  -- no group yet: nothing delivered
    if not found and length > 0 then
      row[3] = length
      row[5], row[7] = waiting_after(stream, '-')
    end
  end
  out[#out + 1] = row
end
return out
"""


@dataclass(frozen=True)
class StreamFacts:
    stream: str
    model: str  # "" for the default streams (any replica reads them)
    priority_class: str
    partition: int
    length: int
    pending: int  # delivered to a replica, not yet acked: in flight
    lag: int  # not yet delivered: waiting
    entries_read: int | None  # delivered so far, ever (Redis 7+); None when unknown
    oldest_age_s: float  # of the oldest waiting entry; 0 when nothing waits
    consumers: int
    # seconds from the read to the nearest deadline among the oldest waiting jobs (at most
    # DEADLINE_SCAN_ENTRIES), negative once it passed; None when none of them has one
    deadline_in_s: float | None = None

    @property
    def seen(self) -> bool:
        """Worth a row: it holds something, or someone reads it."""
        return self.length > 0 or self.consumers > 0 or self.pending > 0


@dataclass(frozen=True)
class NamespaceFacts:
    namespace: str
    server_time: float  # the server's clock at the read (epoch seconds)
    streams: list[StreamFacts]
    dead_letters: int
    replicas: list[ReplicaRecord]


def stream_layout(keys: Keys, models: list[str]) -> list[list[tuple[str, str, str, int]]]:
    """Per partition (one script each): (stream, model, class, partition), defaults first."""
    return [
        [(keys.requests(c, p), "", c, p) for c in PRIORITY_CLASSES]
        + [(keys.model_requests(m, c, p), m, c, p) for m in models for c in PRIORITY_CLASSES]
        for p in range(keys.partitions)
    ]


QUEUE_FACTS_ARGS = [
    GROUP,
    DEADLINE_SCAN_ENTRIES,
    DEADLINE_SCAN_PAGE,
    DEADLINE_SCAN_BYTES,
    EARLIEST_DEADLINE,
    LATEST_DEADLINE,
]


async def read_namespace_facts(redis: Any, keys: Keys) -> NamespaceFacts:
    members = await redis.srandmember(keys.models, MAX_MODELS)
    models = sorted({n for n in (m.decode("utf-8", "replace") for m in members or []) if 0 < len(n) <= 256})
    layout = stream_layout(keys, models)
    calls = [(QUEUE_FACTS_LUA, [s for s, *_ in group], QUEUE_FACTS_ARGS) for group in layout]
    calls.append((READ_REPLICAS_LUA, *read_args(keys)))
    replies = await _run_scripts(redis, calls, extra=("xlen", keys.dead))
    *facts, replicas, dead = replies
    server_ms, streams = None, []
    for group, reply in zip(layout, facts):
        rows = reply if isinstance(reply, list) else []
        server_ms = server_ms or (rows[0] if rows else None)
        streams += [_stream_facts(where, row) for where, row in zip(group, rows[1:])]
    return NamespaceFacts(
        keys.ns,
        (server_ms or 0) / 1000,
        streams,
        dead if isinstance(dead, int) else 0,
        records_from(replicas),
    )


async def _run_scripts(redis: Any, calls: list[tuple[str, list, list]], extra: tuple) -> list[Any]:
    """One pipelined round trip of the scripts (EVALSHA; EVAL on a cluster) and one command;
    a server that lost the scripts gets them loaded and the round trip sent again, once."""
    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for text, script_keys, args in calls:
            if is_cluster(pipe):
                pipe.execute_command("EVAL", text, len(script_keys), *script_keys, *args)
            else:
                pipe.evalsha(_sha(text), len(script_keys), *script_keys, *args)
        pipe.execute_command(extra[0].upper(), *extra[1:])
        replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
            for text in {text for text, _, _ in calls}:
                await redis.script_load(text)
            continue
        return replies
    raise AssertionError("unreachable")


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _stream_facts(where: tuple[str, str, str, int], row: Any) -> StreamFacts:
    stream, model, priority_class, partition = where
    well_formed = isinstance(row, list) and len(row) == 7
    values = [v if isinstance(v, int) else -1 for v in row[:6]] if well_formed else [0] * 6
    length, pending, lag, entries_read, oldest_ms, consumers = values
    length, pending = max(length, 0), max(pending, 0)
    deadline_ms = row[6] if well_formed else None
    return StreamFacts(
        stream,
        model,
        priority_class,
        partition,
        length,
        pending,
        lag if lag >= 0 else max(length - pending, 0),  # acked entries are deleted: the rest waits
        entries_read if entries_read >= 0 else None,
        max(oldest_ms, 0) / 1000,
        max(consumers, 0),
        deadline_ms / 1000 if type(deadline_ms) is int else None,  # None (Lua false): no waiting deadline
    )
