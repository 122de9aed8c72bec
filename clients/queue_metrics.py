"""Queue facts an operator or an autoscaler reads, with a bounded number of Redis commands
whatever the queue holds: per request stream (class, partition, model) its length, the
`engines` group's pending entries (delivered, not yet acked: in flight) and lag (not yet
delivered: waiting), the age of the oldest waiting entry, the consumers; the dead letters;
the replicas' own records (clients/replica_records.py).

One read of a namespace costs one SRANDMEMBER (the published models, at most MAX_MODELS),
then one pipelined round trip: one script per partition (TIME, then per stream XLEN, XINFO
GROUPS and, when something waits, one XRANGE ... COUNT 1 whose entry never leaves the
server), XLEN of the dead letters, and the replica records' script (ZREVRANGE, one HMGET per
replica). So 100,000 queued jobs cost what 1 does (tests/test_dashboard.py counts them).
Everything read is input: wrong types read as empty, numbers are checked.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from conveyor.clients.keys import GROUP, PRIORITY_CLASSES, Keys
from conveyor.clients.redis_cluster import is_cluster
from conveyor.clients.replica_records import READ_REPLICAS_LUA, ReplicaRecord, read_args, records_from

MAX_MODELS = 64  # model names read from <ns>:models per look

# KEYS: request streams of one slot. ARGV: the group. Returns the server time (ms), then per
# stream {length, pending, lag, entries_read, oldest waiting age ms, consumers}; -1: unknown.
QUEUE_FACTS_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now_ms}
local function age_after(stream, start)
  local rows = redis.call('XRANGE', stream, start, '+', 'COUNT', 1)
  if not rows[1] then return -1 end
  return now_ms - tonumber(string.match(rows[1][1], '^(%d+)'))
end
for _, stream in ipairs(KEYS) do
  local row = {0, 0, -1, -1, -1, 0}
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
        if waiting > 0 then row[5] = age_after(stream, '(' .. info['last-delivered-id']) end
      end
    end
    if not found then row[4] = 0 end  -- no group yet: nothing delivered
    if not found and length > 0 then row[3], row[5] = length, age_after(stream, '-') end
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


async def read_namespace_facts(redis: Any, keys: Keys) -> NamespaceFacts:
    members = await redis.srandmember(keys.models, MAX_MODELS)
    models = sorted({n for n in (m.decode("utf-8", "replace") for m in members or []) if 0 < len(n) <= 256})
    layout = stream_layout(keys, models)
    calls = [(QUEUE_FACTS_LUA, [s for s, *_ in group], [GROUP]) for group in layout]
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
    values = [v if isinstance(v, int) else -1 for v in row] if isinstance(row, list) and len(row) == 6 else [0] * 6
    length, pending, lag, entries_read, oldest_ms, consumers = values
    length, pending = max(length, 0), max(pending, 0)
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
    )
