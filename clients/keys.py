"""Redis key names of one Conveyor namespace (and the connection defaults)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

GROUP = "engines"
PRIORITY_CLASSES = ("interactive", "batch")
DEFAULT_NAMESPACE = "conveyor"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"


def default_namespace() -> str:
    return os.environ.get("CONVEYOR_NAMESPACE") or DEFAULT_NAMESPACE


def default_redis_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class Keys:
    """All keys of namespace `ns`; request streams are read by consumer group GROUP."""

    ns: str = field(default_factory=default_namespace)

    def __post_init__(self) -> None:
        if not self.ns or any(ch.isspace() for ch in self.ns):
            raise ValueError(f"namespace must be non-empty without whitespace, got {self.ns!r}")

    def requests(self, priority_class: str) -> str:
        if priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {priority_class!r}")
        return f"{self.ns}:requests:{priority_class}"

    @property
    def interactive(self) -> str:
        return self.requests("interactive")

    @property
    def batch(self) -> str:
        return self.requests("batch")

    @property
    def all_requests(self) -> tuple[str, ...]:
        return tuple(self.requests(c) for c in PRIORITY_CLASSES)

    def out(self, job_id: str) -> str:
        """Per-job output stream of events."""
        return f"{self.ns}:out:{job_id}"

    def job(self, job_id: str) -> str:
        """Per-job status hash."""
        return f"{self.ns}:job:{job_id}"

    @property
    def dead(self) -> str:
        return f"{self.ns}:dead"

    @property
    def cancel(self) -> str:
        """Pub/sub channel carrying the ids of jobs whose cancellation was requested."""
        return f"{self.ns}:cancel"
