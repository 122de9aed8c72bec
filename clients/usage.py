"""Usage you can bill (issue 41): per namespace, per model, per UTC day, the jobs that
finished and their prompt, completion and cached prompt tokens. The replica adds a job's
usage in the script that finishes it (clients/job_record.py FINISH_LUA), once per job, so a
retried or reclaimed job is counted by the attempt that finished it. Counters live in one
hash per day and partition (clients/keys.py ``usage``): field ``<counter>:<model>``.

Producers can write their namespace, so what is read is input: a hash of too many fields is
skipped (and named), a value that is not a count is ignored."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass

COUNTERS = ("jobs", "prompt_tokens", "completion_tokens", "cached_tokens")
USAGE_TTL_S = 400 * 86_400  # a year of days, and a month to bill the last one
MAX_USAGE_DAYS = 366  # one read spans at most this many days
MAX_USAGE_FIELDS = 4096  # a day's hash holds 4 per model: more is not ours


@dataclass
class UsageRow:
    day: str  # YYYY-MM-DD (UTC)
    model: str
    jobs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def usage_day(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).date().isoformat()


def next_day_start(timestamp: float) -> datetime.datetime:
    """The midnight UTC after ``timestamp``: when a day's counters (and budget) start again."""
    day = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).date() + datetime.timedelta(days=1)
    return datetime.datetime.combine(day, datetime.time(), datetime.timezone.utc)


def usage_increments(model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> list:
    """FINISH_LUA's field/count pairs for one finished job."""
    counts = (1, prompt_tokens, completion_tokens, cached_tokens)
    return [item for name, count in zip(COUNTERS, counts) for item in (f"{name}:{model}", count)]


def days_between(start: datetime.date, end: datetime.date) -> list[str]:
    """Each UTC day from ``start`` to ``end`` inclusive; ValueError naming the limit."""
    span = (end - start).days + 1
    if span < 1:
        raise ValueError(f"the range ends ({end}) before it starts ({start})")
    if span > MAX_USAGE_DAYS:
        raise ValueError(f"the range spans {span} days; at most {MAX_USAGE_DAYS} at a time")
    return [(start + datetime.timedelta(days=n)).isoformat() for n in range(span)]


def usage_keys(keys, days: list[str]) -> list[tuple[str, str]]:
    """(day, key) of every day's hash in every partition of the namespace."""
    return [(day, keys.usage(day, partition)) for day in days for partition in range(keys.partitions)]


def merge_usage(day_hashes: list[tuple[str, dict]]) -> list[UsageRow]:
    """Rows per (day, model) from the raw hashes, in day then model order."""
    rows: dict[tuple[str, str], UsageRow] = {}
    for day, fields in day_hashes:
        for raw_field, raw_value in fields.items():
            field = raw_field.decode(errors="replace") if isinstance(raw_field, bytes) else str(raw_field)
            counter, _, model = field.partition(":")
            count = _count(raw_value)
            if counter not in COUNTERS or not model or count is None:
                continue
            row = rows.setdefault((day, model), UsageRow(day, model))
            setattr(row, counter, getattr(row, counter) + count)
    return [rows[key] for key in sorted(rows)]


def read_usage(redis, keys, start: datetime.date, end: datetime.date) -> tuple[list[UsageRow], list[str]]:
    """The namespace's usage rows from ``start`` to ``end`` (UTC days, inclusive), and the
    keys skipped as not ours (another type, or too many fields). ``redis``: a synchronous client."""
    located = usage_keys(keys, days_between(start, end))
    with redis.pipeline(transaction=False) as pipe:
        for _, key in located:
            pipe.hlen(key)
        readable, skipped = _sized(located, pipe.execute(raise_on_error=False))
    with redis.pipeline(transaction=False) as pipe:
        for _, key in readable:
            pipe.hgetall(key)
        hashes = pipe.execute(raise_on_error=False)
    return _rows(readable, hashes), skipped


async def read_usage_async(redis, keys, start: datetime.date, end: datetime.date) -> tuple[list[UsageRow], list[str]]:
    """``read_usage`` on an asyncio client (the gateway)."""
    located = usage_keys(keys, days_between(start, end))
    async with redis.pipeline(transaction=False) as pipe:
        for _, key in located:
            pipe.hlen(key)
        readable, skipped = _sized(located, await pipe.execute(raise_on_error=False))
    async with redis.pipeline(transaction=False) as pipe:
        for _, key in readable:
            pipe.hgetall(key)
        hashes = await pipe.execute(raise_on_error=False)
    return _rows(readable, hashes), skipped


def _sized(located: list[tuple[str, str]], sizes: list) -> tuple[list[tuple[str, str]], list[str]]:
    """(day, key) of the hashes to read, and the keys that are not ours."""
    readable, skipped = [], []
    for (day, key), size in zip(located, sizes):
        if isinstance(size, int) and 0 < size <= MAX_USAGE_FIELDS:
            readable.append((day, key))
        elif not (isinstance(size, int) and size == 0):
            skipped.append(key)
    return readable, skipped


def _rows(readable: list[tuple[str, str]], hashes: list) -> list[UsageRow]:
    return merge_usage([(day, fields) for (day, _), fields in zip(readable, hashes) if isinstance(fields, dict)])


def _count(value) -> int | None:
    try:
        count = int(value)
    except (TypeError, ValueError):
        return None
    return count if 0 <= count < 2**63 else None
