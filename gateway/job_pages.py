"""One job as the dashboard shows it, and the dead letters of a job, read with bounded Redis work.

The job hash `<ns>:job:<id>` is producer-writable input (docs/protocol.md): one script reads
its fields cut to their first bytes in the server, at most MAX_ATTEMPTS_SHOWN attempts (the
first ones, which START_LUA records: `replica:<n>`, `started:<n>`, `trace:<n>` for n up to
the hash's `attempt`, coerced), and the stored terminal event only when it is at most MAX_RESULT_BYTES. Python then
coerces every value: a junk number reads as None, a trace id that is not 32 lowercase hex
digits as "", and every text is cut (prompt PROMPT_CHARS, result RESULT_CHARS, the rest
FIELD_CHARS)."""

from __future__ import annotations

import math
import re
from typing import Any

from conveyor.clients.dead_letters import DeadSummary, dead_page_from, refusal
from conveyor.clients.errors import ProtocolError
from conveyor.clients.events import DoneEvent, ErrorEvent, decode_event_data
from conveyor.clients.job_record import CANCEL_LUA
from conveyor.clients.keys import PRIORITY_CLASSES, Keys
from conveyor.clients.safe_payload import read_payload
from conveyor.clients.submission import cancel_args

MAX_ATTEMPTS_SHOWN = 32  # START_LUA records the first 32 attempts (job_record.MAX_RECORDED_ATTEMPTS)
PROMPT_CHARS = 500
RESULT_CHARS = 2000
FIELD_CHARS = 200
FIELD_BYTES = 2048  # of any hash field that leave the server (prompt_head: 500 characters fit)
MAX_RESULT_BYTES = 1 << 20  # a stored terminal event larger than this is not read
MAX_ENTRY_BYTES = 256 * 1024  # a queued job's request entry larger than this is not read
MAX_MODELS = 64  # published models whose streams may hold a queued job's entry
DEAD_SEARCHED = 200  # newest dead letters searched for a job's own
DEAD_FOUND = 5
TRACE_ID = re.compile(r"[0-9a-f]{32}")
ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")
BASE_FIELDS = ("status", "attempt", "updated", "cancel", "entry", "prompt_head", "finished_attempt")

# KEYS: job hash. ARGV: bytes per field, attempts shown, largest result read, BASE_FIELDS...
# Returns {0, type} when the key is not a hash, else {1, {base values}, {{n, replica, started,
# trace, resume note}, ...}, result size, result or ''}. `attempt` is coerced as START_LUA does.
JOB_PAGE_LUA = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'hash' then return {0, kind} end
local cut, most, largest = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local function short(v) return v and string.sub(v, 1, cut) or '' end
local got = redis.call('HMGET', KEYS[1], unpack(ARGV, 4))
local base = {}
for i = 1, #got do base[i] = short(got[i]) end
local attempt = tonumber(got[2])
if not attempt or attempt ~= attempt or attempt < 0 then attempt = 0 end
attempt = math.floor(math.min(attempt, 1e9))
local attempts = {}
for n = 1, math.min(attempt, most) do
  local name = string.format('%d', n)
  local v = redis.call('HMGET', KEYS[1], 'replica:' .. name, 'started:' .. name, 'trace:' .. name,
                       'resume:' .. name)
  attempts[#attempts + 1] = {n, short(v[1]), short(v[2]), short(v[3]), short(v[4])}
end
local size = redis.call('HSTRLEN', KEYS[1], 'result')
local result = ''
if size <= largest then result = redis.call('HGET', KEYS[1], 'result') or '' end
return {1, base, attempts, size, result}
"""

# KEYS: request streams of the job's partition. ARGV: entry id, largest entry read.
# Returns the entry's fields (flat) from the first stream holding it, {'size', n} when too large,
# or {} when none does. A key of another type is skipped.
QUEUED_ENTRY_LUA = """
for _, stream in ipairs(KEYS) do
  local rows = redis.pcall('XRANGE', stream, ARGV[1], ARGV[1])
  if type(rows) == 'table' and not rows.err and rows[1] then
    local fields, size = rows[1][2], 0
    for i = 1, #fields do size = size + #fields[i] end
    if size > tonumber(ARGV[2]) then return {'size', tostring(size)} end
    return fields
  end
end
return {}
"""

# KEYS: the dead stream. ARGV: job id, letters searched, letters returned, bytes per field,
# summary fields... The newest letters whose job_id is ARGV[1], in DEAD_PAGE_LUA's shape
# (clients/dead_letters.py): {id, {field, value, ..., 'kept', 0|1}}, never the payload.
DEAD_OF_JOB_LUA = """
local searched, most, cut = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local wanted, out, last, seen = {}, {}, '+', 0
for i = 5, #ARGV do wanted[ARGV[i]] = true end
while seen < searched and #out < most do
  local rows = redis.pcall('XREVRANGE', KEYS[1], last, '-', 'COUNT', 25)
  if type(rows) ~= 'table' or rows.err or not rows[1] then break end
  for _, row in ipairs(rows) do
    local fields, kept, small, mine = row[2], 0, {}, false
    for i = 1, #fields - 1, 2 do
      if string.sub(fields[i], 1, 6) == 'field:' then kept = 1
      elseif wanted[fields[i]] then
        if fields[i] == 'job_id' and fields[i + 1] == ARGV[1] then mine = true end
        small[#small + 1] = fields[i]
        small[#small + 1] = string.sub(fields[i + 1], 1, cut)
      end
    end
    if mine and #out < most then
      small[#small + 1] = 'kept'
      small[#small + 1] = tostring(kept)
      out[#out + 1] = {row[1], small}
    end
    last = '(' .. row[1]
  end
  seen = seen + #rows
  if #rows < 25 then break end
end
return out
"""
SUMMARY_FIELDS = ("stream", "entry_id", "reason", "at", "job_id", "truncated", "size")


class NotAJobHash(Exception):
    """The job's key holds another type (any writer of the namespace may have put it there)."""


async def read_job(redis: Any, keys: Keys, job_id: str) -> dict[str, Any] | None:
    """The dashboard's view of one job; None when it has no hash. Raises NotAJobHash."""
    reply = await redis.eval(
        JOB_PAGE_LUA, 1, keys.job(job_id), FIELD_BYTES, MAX_ATTEMPTS_SHOWN, MAX_RESULT_BYTES, *BASE_FIELDS
    )
    if not isinstance(reply, list) or not reply or reply[0] != 1:
        kind = _text(reply[1]) if isinstance(reply, list) and len(reply) > 1 else "?"
        if kind == "none":
            return None
        raise NotAJobHash(kind)
    _, values, attempts, size, result = reply
    base = dict(zip(BASE_FIELDS, (_text(v) for v in values)))
    status = cut(base["status"], 20) or "unknown"
    view: dict[str, Any] = {
        "job_id": job_id,
        "status": status,
        "attempt": _count(base["attempt"]),
        "updated": _epoch(base["updated"]),
        "cancel_requested": base["cancel"] == "1",
        "entry": base["entry"] if ENTRY_ID.fullmatch(base["entry"]) else "",
        "prompt": cut(base["prompt_head"], PROMPT_CHARS),
        "prompt_source": "job hash" if base["prompt_head"] else "",
        "attempts": [_attempt(row) for row in attempts],
        **_outcome(status, int(size), result),
    }
    if not view["prompt"] and status in ("queued", "running") and view["entry"]:
        view["prompt"], view["prompt_source"] = await _prompt_from_entry(redis, keys, job_id, view["entry"])
    return view


def _attempt(row: list) -> dict[str, Any]:
    number, replica, started, trace, resume = row
    trace_id = _text(trace)
    return {
        "attempt": int(number),
        "replica": cut(_text(replica), FIELD_CHARS),
        "started": _epoch(_text(started)),
        "trace_id": trace_id if TRACE_ID.fullmatch(trace_id) else "",
        "resume": cut(_text(resume), FIELD_CHARS),  # how a taken-over attempt began (actors/resume.py)
    }


def _outcome(status: str, size: int, data: Any) -> dict[str, Any]:
    """What the stored terminal event says: the result text or the error, timings and usage."""
    outcome: dict[str, Any] = {"result": "", "error": "", "finish_reason": "", "timings": {}, "usage": {}}
    if size == 0 or status not in ("done", "error", "cancelled", "rejected"):
        return outcome
    if size > MAX_RESULT_BYTES:
        return {**outcome, "error": f"(the stored result is {size} bytes: not shown)"}
    try:
        event = decode_event_data(data, status if status != "rejected" else "error")
    except ProtocolError:
        return {**outcome, "error": "(the stored result is unreadable)"}
    if isinstance(event, DoneEvent):
        texts = [o.text for o in event.all_outputs()]
        outcome.update(result=cut(" | ".join(texts), RESULT_CHARS), finish_reason=event.finish_reason)
        outcome["usage"] = {k: _count(v) for k, v in event.usage.model_dump().items()}
    elif isinstance(event, ErrorEvent):
        outcome["error"] = cut(f"{event.code}: {event.message}", RESULT_CHARS)
    timings = getattr(event, "timings", None)
    if timings is not None:
        outcome["timings"] = {k: _seconds(v) for k, v in timings.model_dump().items()}
    return outcome


async def _prompt_from_entry(redis: Any, keys: Keys, job_id: str, entry: str) -> tuple[str, str]:
    """A job not yet started (or started by a replica that writes no prompt_head): its prompt
    from its request entry, looked up by id in the streams of its partition (the default ones
    and those of at most MAX_MODELS published models)."""
    partition = keys.partition_of(job_id)
    members = await redis.srandmember(keys.models, MAX_MODELS)
    models = sorted({m for m in (_text(n) for n in members or []) if 0 < len(m) <= 256})
    streams = [keys.request_stream(c, m or None, partition) for m in ["", *models] for c in PRIORITY_CLASSES]
    reply = await redis.eval(QUEUED_ENTRY_LUA, len(streams), *streams, entry, MAX_ENTRY_BYTES)
    if not isinstance(reply, list) or not reply:
        return "", "request entry not found"
    if len(reply) == 2 and _text(reply[0]) == "size":
        return "", f"request entry of {_text(reply[1])} bytes: not read"
    fields = {reply[i]: reply[i + 1] for i in range(0, len(reply) - 1, 2)}
    try:
        return cut(prompt_head(read_payload(fields)), PROMPT_CHARS), "request entry"
    except ProtocolError:
        return "", "request entry unreadable"


def prompt_head(payload: dict) -> str:
    """The first PROMPT_CHARS characters of the prompt, or of the last chat message, or
    "<N prompt token ids>" (what START_LUA stores as `prompt_head`)."""
    prompt, messages, token_ids = payload.get("prompt"), payload.get("messages"), payload.get("prompt_token_ids")
    if isinstance(prompt, str):
        return prompt[:PROMPT_CHARS]
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        if isinstance(content, list):  # content parts: their text
            content = " ".join(
                p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        return content[:PROMPT_CHARS] if isinstance(content, str) else ""
    if isinstance(token_ids, list):
        return f"<{len(token_ids)} prompt token ids>"
    return ""


# ---------------------------------------------------------------- actions


async def cancel_job(redis: Any, keys: Keys, job_id: str) -> bool:
    """CANCEL_LUA, as `Client.job(id).cancel()`: False for an unknown or finished job."""
    script_keys, args = cancel_args(keys, job_id)
    return bool(await redis.eval(CANCEL_LUA, len(script_keys), *script_keys, *args))


async def dead_letters_of(redis: Any, keys: Keys, job_id: str) -> list[DeadSummary]:
    """The job's own dead letters among the newest DEAD_SEARCHED (newest first)."""
    reply = await redis.eval(
        DEAD_OF_JOB_LUA, 1, keys.dead, job_id, DEAD_SEARCHED, DEAD_FOUND, FIELD_BYTES, *SUMMARY_FIELDS
    )
    return dead_page_from(keys, reply)


def letter_view(keys: Keys, summary: DeadSummary) -> dict[str, Any]:
    refused = refusal(keys, summary.letter, summary.payload_kept)
    return {
        "dead_id": summary.letter.dead_id,
        "at": summary.letter.at,
        "reason": cut(summary.letter.reason, FIELD_CHARS),
        "requeueable": refused is None,
        "why_not": refused[1] if refused else "",
    }


# ---------------------------------------------------------------- coercion


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _epoch(text: str) -> float | None:
    """Epoch seconds, or None for junk (and for anything not between 1970 and 5138)."""
    value = _number(text)
    return value if value is not None and 0 < value < 1e11 else None


def _seconds(value: Any) -> float | None:
    return round(value, 4) if isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value < 1e9 else None


def _count(value: Any) -> int:
    number = _number(value) if isinstance(value, str) else value
    if not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
        return 0
    return int(min(number, 2**53))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
