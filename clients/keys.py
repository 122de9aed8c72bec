"""Redis key names of one Conveyor namespace (and the connection defaults)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

GROUP = "engines"
PRIORITY_CLASSES = ("interactive", "batch")
DEFAULT_NAMESPACE = "conveyor"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
# No `:` (ns "a" would own the keys of ns "a:requests"), no glob characters (ACL key
# patterns `~<ns>:*` and SCAN MATCH), no braces (hash tags): so no two namespaces' keys collide.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAMESPACE_RULE = "1 to 64 characters from A-Z a-z 0-9 _ - (no ':', spaces, glob characters or braces)"


def default_namespace() -> str:
    return os.environ.get("CONVEYOR_NAMESPACE") or DEFAULT_NAMESPACE


def default_redis_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class Keys:
    """All keys of namespace `ns`; request streams are read by consumer group GROUP."""

    ns: str = field(default_factory=default_namespace)

    def __post_init__(self) -> None:
        if not isinstance(self.ns, str) or not NAMESPACE_PATTERN.fullmatch(self.ns):
            raise ValueError(f"namespace must be {NAMESPACE_RULE}, got {self.ns!r}")

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

    def model_requests(self, model: str, priority_class: str) -> str:
        """Request stream of jobs naming `model`: only replicas serving that model read it."""
        if not model:
            raise ValueError("model must be a non-empty name")
        return f"{self.requests(priority_class)}:{model}"

    def all_model_requests(self, model: str) -> tuple[str, ...]:
        return tuple(self.model_requests(model, c) for c in PRIORITY_CLASSES)

    def request_stream(self, priority_class: str, model: str | None = None) -> str:
        """Where a job goes: its model's own stream when it names one, else the default."""
        return self.model_requests(model, priority_class) if model else self.requests(priority_class)

    def model_requests_pattern(self, priority_class: str) -> str:
        """SCAN MATCH pattern of every model's request stream of one class."""
        return _glob_escape(f"{self.requests(priority_class)}:") + "*"

    def model_of_stream(self, stream: str, priority_class: str) -> str | None:
        """The model named by a per-model request stream key, else None."""
        prefix = f"{self.requests(priority_class)}:"
        if not stream.startswith(prefix):
            return None
        return stream[len(prefix):] or None

    def model_info(self, name: str) -> str:
        """Hash describing a served model for light clients (see clients/model_info.py)."""
        return f"{self.ns}:model:{name}"

    @property
    def models(self) -> str:
        """Set of the names whose model info was published."""
        return f"{self.ns}:models"

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

    @property
    def limits(self) -> str:
        """Hash of the operator limits replicas publish (field max_queue_len: the queue bound)."""
        return f"{self.ns}:limits"


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
