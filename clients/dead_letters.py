"""The dead-letter stream ``<ns>:dead``: list what was parked and why, and requeue it.

A dead letter has ``stream``, ``entry_id``, ``reason``, ``at`` and, when the replica could
read it, ``job_id``. A valid job that may succeed when requeued (e.g. one that exhausted
its deliveries) keeps its original request fields as ``field:<name>``; any other entry
(unreadable, invalid, oversized, a conflicting resubmission) keeps only ``truncated``,
``size``, a digest (``sha256``, or ``sha1`` for oversized entries) and the first bytes of
each field as ``prefix:<name>`` — requeueing those could only fail again.

The dead stream is input (any writer of the namespace may add a letter), so a requeue never
brings a finished job back: the requeue script runs behind FINISHED_GUARD_LUA, which in the
same atomic step refuses a job whose hash says ``done`` or ``cancelled``, or ``error`` for
any reason but ``max_deliveries`` (the one failure a dead letter with a payload records,
and the one a requeue may mend). Such a letter fails alone, with why, and stays.

Everything is read in pages, so a long dead-letter stream costs bounded memory."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from redis.exceptions import ResponseError

from conveyor.clients.job_record import FINAL_STATUSES, REQUEUE_LUA, Status
from conveyor.clients.keys import Keys
from conveyor.clients.safe_payload import readable_job_id

FIELD_PREFIX = "field:"
PAGE = 100
FINISHED_MARK = "FINISHED"  # the guard's error reply: "FINISHED <status>"
MAX_RESULT_READ = 64 * 1024  # a parked job's error event is a few hundred bytes: a larger one is not it

# Prepended to REQUEUE_LUA (same KEYS and ARGV): a job hash (KEYS[3]) whose status is final
# stops the requeue before anything is written, unless it is the error of a job parked after
# max_deliveries (its stored terminal event, msgpack, says so; one over MAX_RESULT_READ
# bytes is never unpacked). Reads only: the status itself is written by job_record.py's
# scripts alone.
FINISHED_GUARD_LUA = """
if KEYS[3] and redis.call('TYPE', KEYS[3]).ok == 'hash' then
  local state = redis.call('HMGET', KEYS[3], 'status', 'result')
  local final = {%s}
  if state[1] and final[state[1]] then
    local code = nil
    if state[1] == '%s' and state[2] and #state[2] <= %d then
      local ok, event = pcall(cmsgpack.unpack, state[2])
      if ok and type(event) == 'table' then code = event['code'] end
    end
    if code ~= 'max_deliveries' then
      return redis.error_reply('%s ' .. state[1])
    end
  end
end
""" % (
    ", ".join(f"['{status}'] = true" for status in sorted(FINAL_STATUSES)),
    Status.ERROR,
    MAX_RESULT_READ,
    FINISHED_MARK,
)
GUARDED_REQUEUE_LUA = FINISHED_GUARD_LUA + REQUEUE_LUA


@dataclass
class DeadLetter:
    dead_id: str
    stream: str
    entry_id: str
    reason: str
    at: float
    fields: dict[str, bytes]  # the original request fields (empty when not kept)
    job_id: str | None = None
    truncated: bool = False  # only a digest and a prefix were kept: it cannot be requeued
    size: int | None = None


def iter_dead(redis, keys: Keys, page: int = PAGE, start: str = "-") -> Iterator[DeadLetter]:
    """Every dead letter from ``start`` on, oldest first, fetched ``page`` at a time."""
    while True:
        rows = redis.xrange(keys.dead, min=start, count=page)
        for dead_id, fields in rows:
            yield _parse(dead_id, fields)
        if len(rows) < page:
            return
        start = "(" + _text(rows[-1][0])


def list_dead(redis, keys: Keys, count: int = PAGE, start: str = "-") -> list[DeadLetter]:
    """The oldest ``count`` dead letters from ``start`` on."""
    return [_parse(dead_id, fields) for dead_id, fields in redis.xrange(keys.dead, min=start, count=count)]


def requeue(
    redis, keys: Keys, dead_ids: list[str] | None = None
) -> tuple[list[str], list[DeadLetter], list[tuple[DeadLetter, str]]]:
    """Requeue the given dead letters (all when None), page by page. Returns the new request
    entry ids, the letters skipped because their payload was not kept, and the letters that
    could not be requeued with why (the dead stream is input: a letter naming a key that is
    not one of this namespace's request streams, a finished job, or one Redis refuses, fails
    alone)."""
    new_ids, skipped, failed = [], [], []
    for letter in _selected(redis, keys, dead_ids):
        refused = refusal(keys, letter)
        if refused is None:
            try:
                new_ids.append(_text(redis.eval(*_requeue_call(keys, letter))))
                _forget_partitioned(redis, keys, letter)
            except ResponseError as exc:
                failed.append((letter, _why(letter, exc)))
        elif refused[0] == SKIPPED:
            skipped.append(letter)
        else:
            failed.append((letter, refused[1]))
    return new_ids, skipped, failed


async def requeue_async(
    redis, keys: Keys, dead_ids: list[str] | None = None
) -> tuple[list[str], list[DeadLetter], list[tuple[DeadLetter, str]]]:
    """`requeue` on a redis.asyncio client (the dashboard's): the same rules, the same script."""
    new_ids, skipped, failed = [], [], []
    async for letter in _selected_async(redis, keys, dead_ids):
        refused = refusal(keys, letter)
        if refused is None:
            try:
                new_ids.append(_text(await redis.eval(*_requeue_call(keys, letter))))
                if keys.partitioned:
                    await redis.xdel(keys.dead, letter.dead_id)
            except ResponseError as exc:
                failed.append((letter, _why(letter, exc)))
        elif refused[0] == SKIPPED:
            skipped.append(letter)
        else:
            failed.append((letter, refused[1]))
    return new_ids, skipped, failed


SKIPPED, FAILED = "skipped", "failed"


def refusal(keys: Keys, letter: DeadLetter, payload_kept: bool | None = None) -> tuple[str, str] | None:
    """Why `conveyor dead requeue` would not requeue this letter ((SKIPPED or FAILED, why)), or None."""
    kept = bool(letter.fields) if payload_kept is None else payload_kept
    if letter.truncated or not kept or not letter.stream:
        return SKIPPED, "payload not kept (unreadable, invalid or conflicting: it would fail again)"
    if not _is_request_stream(keys, letter.stream):
        return FAILED, f"stream: {letter.stream[:200]!r} is not a request stream of this namespace"
    if letter.job_id is not None and keys.partition_of_stream(letter.stream) != keys.partition_of(letter.job_id):
        return FAILED, f"stream: {letter.stream[:200]!r} is not the partition of job {letter.job_id!r}"
    return None


def _is_request_stream(keys: Keys, stream: str) -> bool:
    return any(stream == base or stream.startswith(base + ":") for base in keys.all_requests)


def _selected(redis, keys: Keys, dead_ids: list[str] | None) -> Iterator[DeadLetter]:
    if dead_ids is None:
        yield from iter_dead(redis, keys)
        return
    for dead_id in dead_ids:
        for row_id, fields in redis.xrange(keys.dead, min=dead_id, max=dead_id):
            yield _parse(row_id, fields)


async def _selected_async(redis, keys: Keys, dead_ids: list[str] | None):
    if dead_ids is None:
        start = "-"
        while True:
            rows = await redis.xrange(keys.dead, min=start, count=PAGE)
            for dead_id, fields in rows:
                yield _parse(dead_id, fields)
            if len(rows) < PAGE:
                return
            start = "(" + _text(rows[-1][0])
    for dead_id in dead_ids or ():
        for row_id, fields in await redis.xrange(keys.dead, min=dead_id, max=dead_id):
            yield _parse(row_id, fields)


def _requeue_call(keys: Keys, letter: DeadLetter) -> tuple:
    """EVAL's arguments for one letter (REQUEUE_LUA behind FINISHED_GUARD_LUA): a new entry,
    the letter gone, the job hash queued (a finished job's letter: a FINISHED error, nothing
    written). Partitioned layout: the letter is deleted in a second step (another slot)."""
    job_hash = [keys.job(letter.job_id)] if letter.job_id is not None else []
    pairs = [item for name, value in letter.fields.items() for item in (name, value)]
    dead = letter.stream if keys.partitioned else keys.dead
    return (
        GUARDED_REQUEUE_LUA,
        2 + len(job_hash),
        letter.stream,
        dead,
        *job_hash,
        letter.dead_id,
        repr(time.time()),
        *pairs,
    )


def _why(letter: DeadLetter, exc: ResponseError) -> str:
    """Why Redis refused a letter's requeue, for the operator (a finished job: which one)."""
    mark, _, status = str(exc).partition(" ")
    if mark == FINISHED_MARK:  # status: one of FINAL_STATUSES (the guard matched it)
        return f"job {letter.job_id!r} is {status[:20]}: a finished job is never requeued"
    return str(exc)[:200]


def _forget_partitioned(redis, keys: Keys, letter: DeadLetter) -> None:
    if keys.partitioned:
        redis.xdel(keys.dead, letter.dead_id)


# ---------------------------------------------------------------- newest first, for a page

SUMMARY_FIELDS = ("stream", "entry_id", "reason", "at", "job_id", "truncated", "size")
SUMMARY_CUT = 1024  # bytes of each summary field that leave the server
# KEYS: the dead stream. ARGV: the newest id to show ('+' or '(<id>'), count, bytes per field,
# the summary fields. Per letter: {id, {field, value, ..., 'kept', 0|1}}: never the payload.
DEAD_PAGE_LUA = """
local rows = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', tonumber(ARGV[2]))
local cut, wanted, out = tonumber(ARGV[3]), {}, {}
for i = 4, #ARGV do wanted[ARGV[i]] = true end
for _, row in ipairs(rows) do
  local fields, kept, small = row[2], 0, {}
  for i = 1, #fields - 1, 2 do
    if string.sub(fields[i], 1, 6) == 'field:' then kept = 1
    elseif wanted[fields[i]] then
      small[#small + 1] = fields[i]
      small[#small + 1] = string.sub(fields[i + 1], 1, cut)
    end
  end
  small[#small + 1] = 'kept'
  small[#small + 1] = tostring(kept)
  out[#out + 1] = {row[1], small}
end
return out
"""


@dataclass
class DeadSummary:
    letter: DeadLetter  # without its payload's fields
    payload_kept: bool
    refused: tuple[str, str] | None  # refusal(): why requeue would not take it
    raw_job_id: str  # the letter's job_id field as written (letter.job_id: only a valid one)


def dead_page_args(keys: Keys, before: str | None, count: int) -> tuple:
    """EVAL's arguments of DEAD_PAGE_LUA: `count` letters older than `before` (newest when None)."""
    newest = "(" + before if before else "+"
    return DEAD_PAGE_LUA, 1, keys.dead, newest, count, SUMMARY_CUT, *SUMMARY_FIELDS


def dead_page_from(keys: Keys, reply) -> list[DeadSummary]:
    summaries = []
    for row in reply if isinstance(reply, list) else []:
        dead_id, flat = row
        fields = {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
        kept = fields.pop(b"kept", b"0") == b"1"
        letter = _parse(dead_id, fields)
        summaries.append(DeadSummary(letter, kept, refusal(keys, letter, kept), _text(fields.get(b"job_id", b""))))
    return summaries


def _parse(dead_id, fields: dict) -> DeadLetter:
    text = {_text(k): v for k, v in fields.items()}
    originals = {k[len(FIELD_PREFIX) :]: v for k, v in text.items() if k.startswith(FIELD_PREFIX)}
    return DeadLetter(
        _text(dead_id),
        _text(text.get("stream", b"")),
        _text(text.get("entry_id", b"")),
        _text(text.get("reason", b"")),
        _float(text.get("at")),
        originals,
        job_id=readable_job_id({"job_id": _text(text.get("job_id", b""))}),
        truncated=text.get("truncated") == b"1",
        size=_int(text.get("size")),
    )


def _float(value) -> float:
    try:
        number = float(_text(value or b"0"))
    except ValueError:
        return 0.0
    return number if 0 <= number < 1e11 else 0.0  # a timestamp, or nothing


def _int(value) -> int | None:
    try:
        return int(_text(value)) if value is not None else None
    except ValueError:
        return None


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
