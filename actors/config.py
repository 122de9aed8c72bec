"""Options of one replica (the engine's own options live in engine.EngineConfig)."""

import dataclasses
import os
import socket
from dataclasses import dataclass, field

from conveyor.clients.connection import RedisSettings, resolve_settings
from conveyor.clients.keys import default_namespace


def _env_int_or_none(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass
class ReplicaConfig:
    """`redis` (URL, credentials, TLS) is what the replica connects with; when only
    `redis_url` is given it is resolved with the environment (REDIS_PASSWORD, ...), and
    `redis_url` is then always the URL without credentials."""

    redis_url: str | None = field(default_factory=lambda: os.environ.get("REDIS_URL"))
    redis: RedisSettings | None = None
    namespace: str = field(default_factory=default_namespace)
    # more namespaces the replica serves beside `namespace`, each with its own keys (actors/replica.py Door)
    more_namespaces: tuple[str, ...] = ()
    # a namespace's own Redis user: namespace -> (username, password); others connect as `redis` says
    namespace_users: dict[str, tuple[str, str]] = field(default_factory=dict)
    consumer: str = field(
        default_factory=lambda: os.environ.get("CONVEYOR_CONSUMER", f"{socket.gethostname()}-{os.getpid()}")
    )
    lease_s: float = field(default_factory=lambda: _env_float("CONVEYOR_LEASE_S", 30.0))
    max_deliveries: int = field(default_factory=lambda: int(os.environ.get("CONVEYOR_MAX_DELIVERIES", 3)))
    # times one job may continue from the tokens earlier attempts published (actors/resume.py);
    # 0: a reclaimed job always reruns from the start
    max_resumes: int = field(default_factory=lambda: int(os.environ.get("CONVEYOR_MAX_RESUMES", 3)))
    grace_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GRACE_S", 30.0))
    max_in_flight: int | None = None  # default: 2 x max_num_seqs (a queue ready in the scheduler)
    read_block_ms: int = 1000  # upper bound of the idle probe interval
    # an idle replica waits for a wake-up from the submit script on the partitions it owns and
    # probes one partition (any: stealing, or a missed wake) at most this far apart (no
    # blocking read: it would take in an entry whatever its size); a probe costs one script
    idle_poll_max_s: float = field(default_factory=lambda: _env_float("CONVEYOR_IDLE_POLL_MAX_S", 1.0))
    # partitions owned by leases, idle replicas woken by the submit script (actors/partitions.py);
    # false: every replica reads every partition each poll (the layout before, kept to compare)
    partition_ownership: bool = field(
        default_factory=lambda: os.environ.get("CONVEYOR_PARTITION_OWNERSHIP", "1").lower() not in ("0", "false", "no")
    )
    served_model_name: str | None = field(default_factory=lambda: os.environ.get("CONVEYOR_SERVED_MODEL_NAME"))
    metrics_port: int | None = field(default_factory=lambda: _env_int_or_none("CONVEYOR_METRICS_PORT"))
    metrics_host: str = field(default_factory=lambda: os.environ.get("CONVEYOR_METRICS_HOST", "127.0.0.1"))
    # operator limits: producers cannot lift them
    max_tokens_cap: int | None = field(default_factory=lambda: _env_int_or_none("CONVEYOR_MAX_TOKENS_CAP"))
    max_prompt_tokens: int | None = field(default_factory=lambda: _env_int_or_none("CONVEYOR_MAX_PROMPT_TOKENS"))
    max_queue_len: int | None = field(default_factory=lambda: _env_int_or_none("CONVEYOR_MAX_QUEUE_LEN"))
    # prompt + completion tokens each namespace may use per UTC day: once spent, submits are
    # refused until midnight UTC (a soft bound: jobs queued before it still run)
    token_budget: int | None = field(default_factory=lambda: _env_int_or_none("CONVEYOR_TOKEN_BUDGET"))
    # LoRA adapters jobs may name (`lora`): name -> PEFT adapter directory (conveyor serve --lora-modules)
    lora_modules: dict[str, str] = field(default_factory=dict)
    # how outputs of jobs with tools are read (clients/tool_parsers.py); None: by the chat template
    tool_call_parser: str | None = field(default_factory=lambda: os.environ.get("CONVEYOR_TOOL_CALL_PARSER") or None)
    # bytes of request entries read but not finished (credits bound their number)
    max_bytes_in_flight: int = field(
        default_factory=lambda: int(os.environ.get("CONVEYOR_MAX_BYTES_IN_FLIGHT", 64 * 1024 * 1024))
    )

    def __post_init__(self) -> None:
        if len(set(self.namespaces)) != len(self.namespaces):
            raise ValueError(f"namespace: each served once, got {', '.join(self.namespaces)}")
        for name in self.namespace_users:
            if name not in self.namespaces:
                raise ValueError(f"namespace user: {name!r} is not a served namespace ({', '.join(self.namespaces)})")
        if self.redis is None and self.redis_url:
            self.redis = resolve_settings(self.redis_url)
        if self.redis is not None:
            self.redis_url = self.redis.url  # no password in a config someone may print

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.namespace, *self.more_namespaces)

    def for_namespace(self, namespace: str) -> "ReplicaConfig":
        """This config for one served namespace alone, connecting as that namespace's user."""
        redis = self.redis
        if namespace in self.namespace_users:
            username, password = self.namespace_users[namespace]
            redis = dataclasses.replace(self.redis, username=username, password=password)
        return dataclasses.replace(self, namespace=namespace, more_namespaces=(), namespace_users={}, redis=redis)

    @property
    def renew_interval_s(self) -> float:
        return self.lease_s / 3

    @property
    def reclaim_interval_s(self) -> float:
        return self.lease_s / 2

    @property
    def partition_lease_ms(self) -> int:
        """A partition's owner must renew within this; with checks every lease/6 a dead
        owner's partitions move within 5/6 of a lease (a margin for a loaded box)."""
        return int(self.lease_s * 1000 * 2 / 3)

    @property
    def partition_check_s(self) -> float:
        return self.lease_s / 6
