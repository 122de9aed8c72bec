"""The dead-letter stream ``<ns>:dead``: list what was parked and why, and requeue it.

A dead letter has ``stream``, ``entry_id``, ``reason``, ``at`` and, when the replica could
read it, ``job_id``. A valid job that may succeed when requeued (e.g. one that exhausted
its deliveries) keeps its original request fields as ``field:<name>``; any other entry
(unreadable, invalid, oversized, a conflicting resubmission) keeps only ``truncated``,
``size``, a digest (``sha256``, or ``sha1`` for oversized entries) and the first bytes of
each field as ``prefix:<name>`` — requeueing those could only fail again.

Everything is read in pages, so a long dead-letter stream costs bounded memory."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from redis.exceptions import ResponseError

from clients.job_record import REQUEUE_LUA
from clients.keys import Keys
from clients.safe_payload import readable_job_id

FIELD_PREFIX = "field:"
PAGE = 100


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
    not one of this namespace's request streams, or one Redis refuses, fails alone)."""
    new_ids, skipped, failed = [], [], []
    for letter in _selected(redis, keys, dead_ids):
        if letter.truncated or not letter.fields or not letter.stream:
            skipped.append(letter)
        elif not _is_request_stream(keys, letter.stream):
            failed.append((letter, f"stream: {letter.stream[:200]!r} is not a request stream of this namespace"))
        elif letter.job_id is not None and keys.partition_of_stream(letter.stream) != keys.partition_of(letter.job_id):
            failed.append((letter, f"stream: {letter.stream[:200]!r} is not the partition of job {letter.job_id!r}"))
        else:
            try:
                new_ids.append(_requeue_one(redis, keys, letter))
            except ResponseError as exc:
                failed.append((letter, str(exc)[:200]))
    return new_ids, skipped, failed


def _is_request_stream(keys: Keys, stream: str) -> bool:
    return any(stream == base or stream.startswith(base + ":") for base in keys.all_requests)


def _selected(redis, keys: Keys, dead_ids: list[str] | None) -> Iterator[DeadLetter]:
    if dead_ids is None:
        yield from iter_dead(redis, keys)
        return
    for dead_id in dead_ids:
        for row_id, fields in redis.xrange(keys.dead, min=dead_id, max=dead_id):
            yield _parse(row_id, fields)


def _requeue_one(redis, keys: Keys, letter: DeadLetter) -> str:
    """One atomic step (REQUEUE_LUA): a new entry, the letter gone, the job hash queued.
    Partitioned layout: the letter is deleted in a second step (another slot)."""
    job_hash = [keys.job(letter.job_id)] if letter.job_id is not None else []
    pairs = [item for name, value in letter.fields.items() for item in (name, value)]
    dead = letter.stream if keys.partitioned else keys.dead
    entry_id = redis.eval(
        REQUEUE_LUA, 2 + len(job_hash), letter.stream, dead, *job_hash, letter.dead_id, repr(time.time()), *pairs
    )
    if keys.partitioned:
        redis.xdel(keys.dead, letter.dead_id)
    return _text(entry_id)


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
