"""What each replica says about itself, for operators (the dashboard, `/metrics`).

Every REPLICA_BEAT_S a replica's announcer writes `<ns>:replica:<consumer>` (a hash of the
fields below, TTL REPLICA_RECORD_TTL_S) and scores its name in `<ns>:replicas` with the
time; names older than the TTL leave the set on the next beat. A replica is *live* while
its last record is at most REPLICA_GONE_S old, *gone* after (its record stays until the TTL).

Readers treat both keys as input (any writer of the namespace can write them): at most
MAX_REPLICAS names are read, each field at most MAX_FIELD_BYTES long (cut in the script, so
a huge field never crosses the network), numbers checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from conveyor.clients.keys import Keys

REPLICA_BEAT_S = 2.0
REPLICA_GONE_S = 10.0
REPLICA_RECORD_TTL_S = 3600
MAX_REPLICAS = 64
MAX_FIELD_BYTES = 200
FIELDS = (
    "model",
    "state",  # serving | draining | stopped
    "started_at",
    "seen_at",
    "running",
    "waiting",
    "max_num_seqs",
    "kv_usage",
    "tokens_per_s",
    "generated_tokens",
    "finished",
)

# KEYS: the replicas set. ARGV: how many, the record key prefix, field bytes, fields...
# Returns {name, score, {field values...}} per replica, most recently seen first.
READ_REPLICAS_LUA = """
local names = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
local cut, out = tonumber(ARGV[3]), {}
for i = 1, #names, 2 do
  local name = string.sub(names[i], 1, 256)
  local values = redis.pcall('HMGET', ARGV[2] .. names[i], unpack(ARGV, 4))
  local row = {}
  if type(values) == 'table' and not values.err then
    for j = 1, #values do row[j] = values[j] and string.sub(values[j], 1, cut) or '' end
  end
  out[#out + 1] = {name, names[i + 1], row}
end
return out
"""


@dataclass(frozen=True)
class ReplicaRecord:
    consumer: str
    seen_at: float
    fields: dict[str, str]

    def number(self, name: str) -> float | None:
        try:
            value = float(self.fields.get(name, ""))
        except ValueError:
            return None
        return value if math.isfinite(value) and abs(value) < 2**53 else None

    def live(self, now: float) -> bool:
        return now - self.seen_at <= REPLICA_GONE_S and self.fields.get("state") != "stopped"

    def view(self, now: float) -> dict[str, Any]:
        """Plain data for the dashboard: strings cut, numbers checked."""
        return {
            "consumer": self.consumer,
            "model": self.fields.get("model", ""),
            "state": self.fields.get("state", "") if self.live(now) else "gone",
            "live": self.live(now),
            "last_seen_s": max(0.0, round(now - self.seen_at, 1)),
            **{name: self.number(name) for name in FIELDS[4:]},
        }


def record_fields(**values: Any) -> dict[str, str]:
    """The hash a replica writes (unknown names refused: FIELDS is the schema)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"not replica record fields: {sorted(unknown)}")
    return {name: str(value) for name, value in values.items() if value is not None}


def queue_beat(pipe: Any, keys: Keys, consumer: str, fields: dict[str, str], now: float) -> None:
    """One beat on a pipeline: the record, its name's score, and old names trimmed."""
    record = keys.replica(consumer)
    pipe.hset(record, mapping=fields)
    pipe.expire(record, REPLICA_RECORD_TTL_S)
    pipe.zadd(keys.replicas, {consumer: now})
    pipe.zremrangebyscore(keys.replicas, "-inf", now - REPLICA_RECORD_TTL_S)
    pipe.expire(keys.replicas, REPLICA_RECORD_TTL_S)


def read_args(keys: Keys) -> tuple[list[str], list[Any]]:
    """(KEYS, ARGV) of READ_REPLICAS_LUA."""
    return [keys.replicas], [MAX_REPLICAS, keys.replica(""), MAX_FIELD_BYTES, *FIELDS]


def records_from(reply: Any) -> list[ReplicaRecord]:
    rows = reply if isinstance(reply, list) else []
    records = []
    for row in rows:
        try:
            name, score, values = row
            seen_at = float(score)
        except (TypeError, ValueError):
            continue
        texts = [_text(v) for v in values] if isinstance(values, list) else []
        records.append(ReplicaRecord(_text(name), seen_at, {f: v for f, v in zip(FIELDS, texts) if v}))
    return records


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
