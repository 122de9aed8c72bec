"""One job looked up by id for an operator: its status (event_reader.status_from_hash) and
the first events of its out stream, with a bounded cost whatever a writer put there: one
script returns the hash's status fields and at most MAX_EVENTS events, each field cut to
its first bytes in the server (an event cut short shows as its type and size)."""

from __future__ import annotations

import re
from typing import Any

from conveyor.clients.event_reader import status_from_hash
from conveyor.clients.events import decode_event_data
from conveyor.clients.job_record import Field
from conveyor.clients.keys import Keys
from conveyor.clients.limits import JOB_ID_PATTERN

MAX_EVENTS = 50
EVENT_BYTES = 8192  # of an event's data that leave the server
STATUS_FIELDS = (Field.STATUS, Field.ATTEMPT, Field.UPDATED, Field.CANCEL)

# KEYS: job hash, out stream. ARGV: events, event bytes, status fields...
# Returns {{status field values}, {{id, type, size, data prefix}, ...}, more (0|1)}.
JOB_LOOKUP_LUA = """
local values = {}
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local got = redis.call('HMGET', KEYS[1], unpack(ARGV, 3))
  for i = 1, #got do values[i] = got[i] and string.sub(got[i], 1, 64) or '' end
end
local events, count, cut = {}, tonumber(ARGV[1]), tonumber(ARGV[2])
local rows = redis.pcall('XRANGE', KEYS[2], '-', '+', 'COUNT', count + 1)
if type(rows) ~= 'table' or rows.err then rows = {} end
for i = 1, math.min(#rows, count) do
  local kind, data = '', ''
  local fields = rows[i][2]
  for j = 1, #fields - 1, 2 do
    if fields[j] == 'type' then kind = string.sub(fields[j + 1], 1, 16) end
    if fields[j] == 'data' then data = fields[j + 1] end
  end
  events[#events + 1] = {rows[i][1], kind, #data, string.sub(data, 1, cut)}
end
return {values, events, #rows > count and 1 or 0}
"""


def valid_job_id(job_id: str) -> bool:
    return bool(re.fullmatch(JOB_ID_PATTERN, job_id))


def lookup_args(keys: Keys, job_id: str) -> tuple:
    """EVAL's arguments of JOB_LOOKUP_LUA (the job hash and out stream share a slot)."""
    return JOB_LOOKUP_LUA, 2, keys.job(job_id), keys.out(job_id), MAX_EVENTS, EVENT_BYTES, *STATUS_FIELDS


def lookup_from(job_id: str, reply: Any) -> dict[str, Any]:
    values, rows, more = reply
    fields = {name.encode(): value for name, value in zip(STATUS_FIELDS, values) if value}
    status = status_from_hash(job_id, fields).model_dump()
    return {**status, "events": [_event(row) for row in rows], "more_events": bool(more)}


def _event(row: list) -> dict[str, Any]:
    entry_id, kind, size, data = row
    shown: dict[str, Any] = {"id": _text(entry_id), "type": _text(kind), "bytes": int(size)}
    if int(size) > EVENT_BYTES:
        return {**shown, "text": f"({int(size)} bytes, not shown)"}
    try:
        event = decode_event_data(data, _text(kind) or None)
    except Exception:  # noqa: BLE001 - junk an out stream may hold is shown as junk
        return {**shown, "text": "(unreadable event)"}
    return {**shown, "attempt": event.attempt, **_what(event)}


def _what(event: Any) -> dict[str, Any]:
    if event.type == "token":
        return {"index": event.index, "text": event.text}
    if event.type == "done":
        return {"text": " | ".join(o.text for o in event.all_outputs()), "finish_reason": event.finish_reason}
    if event.type == "error":
        return {"text": f"{event.code}: {event.message}"}
    return {"text": event.type}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
