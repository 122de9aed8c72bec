"""Redis key names of one Conveyor namespace (and the connection defaults).

Two layouts (docs/protocol.md "Key layouts"):

- single server, one partition (the default): `<ns>:requests:<class>`, `<ns>:job:<id>`, ...
- partitioned (cluster mode, or `partitions > 1`): every key a script or MULTI touches
  together carries one hash tag. Partition `k` of the request streams, and the hash, out
  stream and limits copy of every job whose id hashes to `k`, live under `<ns>:{p<k>}:`;
  the namespace-wide model info under `<ns>:{<ns>}:`. A job's partition is
  `crc32(job_id) % partitions` (zlib's CRC-32 of the id's UTF-8 bytes), so any producer can
  find it, and a job's entry must go to its own partition's stream.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field

GROUP = "engines"
PRIORITY_CLASSES = ("interactive", "batch")
DEFAULT_NAMESPACE = "conveyor"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_CLUSTER_PARTITIONS = 4  # request stream partitions per class in cluster mode
MAX_PARTITIONS = 1024
# No `:` (ns "a" would own the keys of ns "a:requests"), no glob characters (ACL key
# patterns `~<ns>:*` and SCAN MATCH), no braces (hash tags): so no two namespaces' keys collide.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAMESPACE_RULE = "1 to 64 characters from A-Z a-z 0-9 _ - (no ':', spaces, glob characters or braces)"


def default_namespace() -> str:
    return os.environ.get("CONVEYOR_NAMESPACE") or DEFAULT_NAMESPACE


def default_redis_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def partitions_setting(value: str | None) -> int | None:
    """A $CONVEYOR_PARTITIONS value as an integer (None when unset)."""
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"CONVEYOR_PARTITIONS must be an integer, got {value!r}") from None


def default_partitions(cluster: bool) -> int:
    """$CONVEYOR_PARTITIONS, else 1 on a single server and DEFAULT_CLUSTER_PARTITIONS in cluster mode."""
    value = partitions_setting(os.environ.get("CONVEYOR_PARTITIONS"))
    if value is None:
        return DEFAULT_CLUSTER_PARTITIONS if cluster else 1
    return value


@dataclass(frozen=True)
class Keys:
    """All keys of namespace `ns`; request streams are read by consumer group GROUP.
    `partitions` request streams per class; `cluster` (or partitions > 1): the hash-tagged layout."""

    ns: str = field(default_factory=default_namespace)
    partitions: int = 1
    cluster: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ns, str) or not NAMESPACE_PATTERN.fullmatch(self.ns):
            raise ValueError(f"namespace must be {NAMESPACE_RULE}, got {self.ns!r}")
        if not isinstance(self.partitions, int) or not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be an integer from 1 to {MAX_PARTITIONS}, got {self.partitions!r}")

    @classmethod
    def of(cls, ns: str | None = None, *, cluster: bool = False, partitions: int | None = None) -> Keys:
        """The keys of `ns` as clients and replicas of a deployment agree on them."""
        return cls(ns or default_namespace(), partitions or default_partitions(cluster), cluster)

    @property
    def partitioned(self) -> bool:
        return self.cluster or self.partitions > 1

    def partition_of(self, job_id: str) -> int:
        """The partition of a job: its streams' slot holds its hash, out stream and limits copy."""
        return zlib.crc32(job_id.encode()) % self.partitions if self.partitioned else 0

    def _prefix(self, partition: int) -> str:
        return f"{self.ns}:{{p{partition}}}" if self.partitioned else self.ns

    def requests(self, priority_class: str, partition: int = 0) -> str:
        if priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {priority_class!r}")
        return f"{self._prefix(partition)}:requests:{priority_class}"

    def partition_of_stream(self, stream: str) -> int | None:
        """The partition a request stream key names (0 in the single-server layout)."""
        if not self.partitioned:
            return 0
        found = _PARTITION_TAG.match(stream[len(self.ns) :]) if stream.startswith(self.ns) else None
        return int(found.group(1)) if found else None

    @property
    def interactive(self) -> str:
        return self.requests("interactive")

    @property
    def batch(self) -> str:
        return self.requests("batch")

    @property
    def all_requests(self) -> tuple[str, ...]:
        """Every default request stream: all classes, each in every partition."""
        return tuple(self.requests(c, p) for c in PRIORITY_CLASSES for p in range(self.partitions))

    def model_requests(self, model: str, priority_class: str, partition: int = 0) -> str:
        """Request stream of jobs naming `model`: only replicas serving that model read it."""
        if not model:
            raise ValueError("model must be a non-empty name")
        return f"{self.requests(priority_class, partition)}:{model}"

    def all_model_requests(self, model: str) -> tuple[str, ...]:
        return tuple(self.model_requests(model, c, p) for c in PRIORITY_CLASSES for p in range(self.partitions))

    def request_stream(self, priority_class: str, model: str | None = None, partition: int = 0) -> str:
        """Where a job goes: its model's own stream when it names one, else the default."""
        if model:
            return self.model_requests(model, priority_class, partition)
        return self.requests(priority_class, partition)

    def job_request_stream(self, job_id: str, priority_class: str, model: str | None = None) -> str:
        """The stream a producer adds job `job_id` to: its class, its model, its partition."""
        return self.request_stream(priority_class, model, self.partition_of(job_id))

    def model_requests_pattern(self, priority_class: str) -> str:
        """SCAN MATCH pattern of every model's request stream of one class (every partition)."""
        if self.partitioned:
            return _glob_escape(f"{self.ns}:{{p") + "*" + _glob_escape(f"}}:requests:{priority_class}:") + "*"
        return _glob_escape(f"{self.requests(priority_class)}:") + "*"

    def model_of_stream(self, stream: str, priority_class: str) -> str | None:
        """The model named by a per-model request stream key, else None."""
        partition = self.partition_of_stream(stream)
        if partition is None or partition >= self.partitions:
            return None
        prefix = f"{self.requests(priority_class, partition)}:"
        if not stream.startswith(prefix):
            return None
        return stream[len(prefix) :] or None

    def model_info(self, name: str) -> str:
        """Hash describing a served model for light clients (see clients/model_info.py)."""
        return f"{self._namespace_prefix}:model:{name}"

    @property
    def models(self) -> str:
        """Set of the names whose model info was published (one slot with model_info: one MULTI)."""
        return f"{self._namespace_prefix}:models"

    def replica(self, consumer: str) -> str:
        """Hash a replica writes about itself every few seconds (clients/replica_records.py)."""
        return f"{self._namespace_prefix}:replica:{consumer}"

    @property
    def replicas(self) -> str:
        """Sorted set of replica consumer names by the time of their last record (one slot with them)."""
        return f"{self._namespace_prefix}:replicas"

    @property
    def _namespace_prefix(self) -> str:
        return f"{self.ns}:{{{self.ns}}}" if self.partitioned else self.ns

    def out(self, job_id: str) -> str:
        """Per-job output stream of events."""
        return f"{self._prefix(self.partition_of(job_id))}:out:{job_id}"

    def job(self, job_id: str) -> str:
        """Per-job status hash."""
        return f"{self._prefix(self.partition_of(job_id))}:job:{job_id}"

    def usage(self, day: str, partition: int = 0) -> str:
        """Hash of one UTC day's usage (``YYYY-MM-DD``) by the jobs of one partition: field
        ``<counter>:<model>`` -> count (clients/usage.py). In the job's slot, so the script
        that finishes a job counts it."""
        return f"{self._prefix(partition)}:usage:{day}"

    def usage_of(self, job_id: str, day: str) -> str:
        return self.usage(day, self.partition_of(job_id))

    @property
    def partition_owners(self) -> str:
        """Hash of partition leases: field `<k>` -> `<expiry ms> <consumer>` (actors/partitions.py)."""
        return f"{self._namespace_prefix}:partition-owners"

    @property
    def partition_takers(self) -> str:
        """Sorted set of the replicas taking partitions: consumer -> expiry ms (one slot with
        partition_owners; not `replicas`, the operators' records scored in seconds)."""
        return f"{self._namespace_prefix}:partition-takers"

    @property
    def webhooks(self) -> str:
        """Stream of webhook events waiting to be delivered (clients/webhook_queue.py); the
        gateway's sender reads it in group WEBHOOK_GROUP, so a delivery survives restarts."""
        return f"{self._namespace_prefix}:webhooks"

    @property
    def webhooks_dead(self) -> str:
        """Stream of webhook events given up on (every retry failed for the retry window)."""
        return f"{self._namespace_prefix}:webhooks:dead"

    @property
    def dead(self) -> str:
        return f"{self.ns}:dead"

    @property
    def cancel(self) -> str:
        """Pub/sub channel carrying the ids of jobs whose cancellation was requested."""
        return f"{self.ns}:cancel"

    def limits_of(self, partition: int = 0) -> str:
        """Hash of the operator limits replicas publish (field max_queue_len: the queue bound);
        one copy per partition, so the submit script reads the one in its job's slot."""
        return f"{self._prefix(partition)}:limits"

    def job_limits(self, job_id: str) -> str:
        """The limits copy in job `job_id`'s slot (the one its submit script reads)."""
        return self.limits_of(self.partition_of(job_id))

    @property
    def limits(self) -> str:
        return self.limits_of(0)

    @property
    def all_limits(self) -> tuple[str, ...]:
        return tuple(self.limits_of(p) for p in range(self.partitions))


_PARTITION_TAG = re.compile(r":\{p(\d{1,4})\}:")


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
