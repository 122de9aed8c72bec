"""The dead-letter stream ``<ns>:dead``: list what was parked and why, and requeue it.

A dead-letter entry keeps the original request fields as ``field:<name>`` next to
``stream``, ``entry_id``, ``reason`` and ``at``. Requeueing puts the original fields back
on their stream as a new entry and gives the job a fresh delivery budget."""
from __future__ import annotations

from dataclasses import dataclass

from clients.errors import ProtocolError
from clients.keys import Keys
from clients.safe_payload import read_payload, readable_job_id

FIELD_PREFIX = "field:"


@dataclass
class DeadLetter:
    dead_id: str
    stream: str
    entry_id: str
    reason: str
    at: float
    fields: dict[str, bytes]

    @property
    def job_id(self) -> str | None:
        try:
            return readable_job_id(read_payload(self.fields))
        except ProtocolError:  # an undecodable payload is exactly what dead letters hold
            return None


def list_dead(redis, keys: Keys, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters."""
    return [_parse(dead_id, fields) for dead_id, fields in redis.xrange(keys.dead, count=count)]


def requeue(redis, keys: Keys, dead_ids: list[str] | None = None) -> list[str]:
    """Requeue the given dead letters (all when None); returns the new request entry ids."""
    letters = [d for d in list_dead(redis, keys, count=100_000) if dead_ids is None or d.dead_id in dead_ids]
    new_ids = []
    for letter in letters:
        # a fresh delivery budget; "entry" will name the entry it now runs from. An existing
        # hash keeps its TTL; none is created here (the replica creates it, with a TTL).
        reset = letter.job_id is not None and redis.exists(keys.job(letter.job_id))
        with redis.pipeline(transaction=True) as pipe:
            if reset:
                pipe.hdel(keys.job(letter.job_id), "entry", "finished_attempt")
                pipe.hset(keys.job(letter.job_id), mapping={"attempt": 0, "status": "queued"})
            pipe.xadd(letter.stream, letter.fields)
            pipe.xdel(keys.dead, letter.dead_id)
            results = pipe.execute()
        new_ids.append(_text(results[-2]))
    return new_ids


def _parse(dead_id, fields: dict) -> DeadLetter:
    text = {_text(k): v for k, v in fields.items()}
    originals = {k[len(FIELD_PREFIX):]: v for k, v in text.items() if k.startswith(FIELD_PREFIX)}
    return DeadLetter(_text(dead_id), _text(text.get("stream", b"")), _text(text.get("entry_id", b"")),
                      _text(text.get("reason", b"")), float(_text(text.get("at", b"0")) or 0), originals)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
