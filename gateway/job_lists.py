"""Pages of jobs by state for the dashboard, each costing bounded Redis work whatever the
namespace holds.

- By status (queued, running, done, failed = error or cancelled): SCAN over the namespace's
  job hashes (`<ns>:job:*`, or `<ns>:{p*}:job:*` in the partitioned layout), COUNT SCAN_COUNT,
  TYPE hash, then one pipelined HMGET of the keys found; at most MAX_SCANS such steps per
  page, which holds at most PAGE jobs. The cursor, `<node>.<scan cursor>.<skip>`, names the
  cluster primary (0 on a single server), the SCAN cursor of the step to resume and how many
  keys of that step were already shown. SCAN's guarantees are the list's: a job that exists
  the whole time is listed, possibly twice; jobs come in no particular order, and a page may
  hold fewer than PAGE jobs while more follow (`next` says so).
- Webhook dead letters (`Keys.webhooks_dead`): XREVRANGE with an exclusive start id, newest
  first, every field cut in the server."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from conveyor.clients.job_lookup import valid_job_id
from conveyor.clients.keys import Keys
from conveyor.clients.redis_cluster import is_cluster

PAGE = 50
SCAN_COUNT = 250
MAX_SCANS = 8  # SCAN steps per page: at most about MAX_SCANS x SCAN_COUNT keys looked at
STATES = {"queued": ("queued",), "running": ("running",), "done": ("done",), "failed": ("error", "cancelled")}
CURSOR = re.compile(r"(\d{1,4})\.(\d{1,20})\.(\d{1,5})")
MAX_SCAN_CURSOR = 2**64 - 1
ROW_FIELDS = ("status", "attempt", "updated")
WEBHOOK_FIELD_BYTES = 512
WEBHOOK_FIELDS_SHOWN = 12
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


@dataclass(frozen=True)
class Cursor:
    node: int = 0
    scan: int = 0
    skip: int = 0

    def text(self) -> str:
        return f"{self.node}.{self.scan}.{self.skip}"


def parse_cursor(text: str | None) -> Cursor:
    """A list cursor from a query; raises ValueError for anything this module did not make."""
    if not text:
        return Cursor()
    found = CURSOR.fullmatch(text)
    if not found or int(found.group(2)) > MAX_SCAN_CURSOR:
        raise ValueError(text)
    node, scan, skip = map(int, found.groups())
    return Cursor(node, scan, skip)


def job_key_pattern(keys: Keys) -> str:
    """SCAN MATCH pattern of the namespace's job hashes (namespaces hold no glob characters)."""
    return f"{keys.ns}:{{p*}}:job:*" if keys.partitioned else f"{keys.ns}:job:*"


def job_id_of_key(keys: Keys, key: str) -> str | None:
    """The job id a job hash key names, when it is where that job's hash belongs."""
    head, sep, job_id = key.partition(":job:")
    if not sep or not valid_job_id(job_id) or keys.job(job_id) != key:
        return None
    return job_id


async def list_jobs(redis: Any, keys: Keys, state: str, cursor: Cursor) -> tuple[list[dict], Cursor | None]:
    """At most PAGE jobs in `state` from `cursor` on, and the cursor of the rest (None: no more)."""
    statuses, nodes = STATES[state], _primaries(redis)
    rows: list[dict] = []
    seen: set[str] = set()
    node, scan, skip = cursor.node, cursor.scan, cursor.skip
    for _ in range(MAX_SCANS):
        if node >= len(nodes):
            return rows, None
        next_scan, found = await _scan(redis, nodes[node], scan, job_key_pattern(keys))
        for index, row in await _rows(redis, keys, found, skip):
            if row["status"] in statuses and row["job_id"] not in seen:
                if len(rows) == PAGE:
                    return rows, Cursor(node, scan, index)  # this step again, from this key on
                rows.append(row)
                seen.add(row["job_id"])
        skip = 0
        if next_scan == 0:
            node, scan = node + 1, 0
        else:
            scan = next_scan
    return rows, (Cursor(node, scan, 0) if node < len(nodes) else None)


def _primaries(redis: Any) -> list[Any]:
    """The nodes to SCAN in turn: the cluster's primaries (by name), or the one server."""
    if is_cluster(redis):
        return sorted(redis.get_primaries(), key=lambda node: node.name)
    return [None]


async def _scan(redis: Any, node: Any, cursor: int, pattern: str) -> tuple[int, list[str]]:
    args = ("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT, "TYPE", "hash")
    reply = await (
        redis.execute_command(*args, target_nodes=node) if node is not None else redis.execute_command(*args)
    )
    if isinstance(reply, dict):  # a cluster client's reply by node
        reply = next(iter(reply.values()), [0, []])
    next_cursor, found = reply
    return int(next_cursor), [_text(k) for k in found]


async def _rows(redis: Any, keys: Keys, found: list[str], skip: int) -> list[tuple[int, dict]]:
    """(index in the SCAN step, row) of the job hashes found, from key `skip` on."""
    named = [(i, key, job_id) for i, key in enumerate(found) if i >= skip and (job_id := job_id_of_key(keys, key))]
    if not named:
        return []
    pipe = redis.pipeline(transaction=False)
    for _, key, _ in named:
        pipe.hmget(key, *ROW_FIELDS)
    replies = await pipe.execute(raise_on_error=False)
    rows = []
    for (index, _, job_id), values in zip(named, replies):
        if isinstance(values, list):  # not an error (the key changed type meanwhile)
            status, attempt, updated = (_text(v)[:64] for v in values)
            rows.append((index, {"job_id": job_id, "status": status, "attempt": attempt, "updated": updated}))
    return rows


# ---------------------------------------------------------------- webhook dead letters

# KEYS: the stream. ARGV: newest id ('+' or '(<id>'), count, bytes per field, fields per entry.
WEBHOOK_DEAD_LUA = """
local rows = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', tonumber(ARGV[2]))
local cut, most, out = tonumber(ARGV[3]), 2 * tonumber(ARGV[4]), {}
for _, row in ipairs(rows) do
  local small = {}
  for i = 1, math.min(#row[2], most) do small[i] = string.sub(row[2][i], 1, cut) end
  out[#out + 1] = {row[1], small}
end
return out
"""
WEBHOOK_NAMED = ("id", "type", "created_at", "data_id")


async def webhook_dead_page(redis: Any, keys: Keys, before: str | None) -> tuple[list[dict], str | None]:
    """At most PAGE webhook dead letters older than `before` (newest when None), newest first."""
    newest = "(" + before if before else "+"
    key_type = _text(await redis.type(keys.webhooks_dead))
    if key_type not in ("stream", "none"):
        return [], None  # a key of another type holds nothing to show
    reply = await redis.eval(
        WEBHOOK_DEAD_LUA, 1, keys.webhooks_dead, newest, PAGE, WEBHOOK_FIELD_BYTES, WEBHOOK_FIELDS_SHOWN
    )
    letters = [_webhook_letter(row) for row in reply if isinstance(row, list) and len(row) == 2]
    return letters, (letters[-1]["dead_id"] if len(letters) == PAGE else None)


def _webhook_letter(row: list) -> dict[str, Any]:
    dead_id, flat = row
    fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    named = {name: fields.pop(name, "") for name in WEBHOOK_NAMED}
    job_id = named["data_id"] if named["type"].startswith("job.") and valid_job_id(named["data_id"]) else ""
    return {
        "dead_id": _text(dead_id),
        "event_id": named["id"],
        "type": named["type"],
        "created_at": _epoch(named["created_at"]),
        "data_id": named["data_id"],
        "job_id": job_id,  # a job.* event's job: linked to its page
        "detail": "; ".join(f"{k}={v}" for k, v in fields.items()),
    }


def _epoch(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < 1e11 else None


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
