"""Options of one gateway. Each has a flag of `conveyor gateway` and an environment variable;
defaults are safe on a laptop (loopback address, no key means one local namespace)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from conveyor.clients.connection import RedisSettings, resolve_settings
from conveyor.clients.keys import NAMESPACE_PATTERN, NAMESPACE_RULE, default_namespace
from conveyor.clients.limits import MAX_N
from conveyor.gateway.allowed_hosts import HostPolicy
from conveyor.gateway.webhook_config import check_pacing, check_url

DEFAULT_MAX_STORED_BYTES = 64 << 20


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def _env_float(name: str, default: float) -> float:
    return float(_env(name, str(default)))


def _env_int(name: str, default: int) -> int:
    return int(_env(name, str(default)))


@dataclass
class GatewaySettings:
    redis: RedisSettings = field(default_factory=resolve_settings)  # URL, credentials, TLS
    namespace: str = field(default_factory=default_namespace)  # used when no API key is configured
    host: str = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_PORT", 8000))
    # API keys: a JSON/YAML file {key: {namespace, priority_class}} and/or "key=ns[:class],..."
    keys_file: str | None = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_KEYS_FILE"))
    api_keys: str | None = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_API_KEYS"), repr=False)
    # every job gets deadline = now + timeout_s (a request may ask for less: X-Conveyor-Timeout-S)
    timeout_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_TIMEOUT_S", 600.0))
    # the gateway's own bound of each request stream (0 = none; the replicas' bound applies anyway)
    max_queue_len: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_QUEUE_LEN", 0))
    # a model is live while one of its replicas touched its request streams this recently
    replica_idle_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_REPLICA_IDLE_S", 60.0))
    # how long jobs' events and status stay in Redis (the gateway reads them at once)
    result_ttl: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_RESULT_TTL", 3600))
    max_body_bytes: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_BODY_BYTES", 16 << 20))
    # how long one look at the published models and their replicas is reused
    model_cache_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_MODEL_CACHE_S", 1.0))
    log_level: str = field(default_factory=lambda: _env("CONVEYOR_LOG_LEVEL", "info").lower())
    # connection limits (docs/security.md "Hostile HTTP clients")
    max_connections: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_CONNECTIONS", 1000))
    # open connections of one client address (an IPv6 /64) at most; 0: 3/4 of max_connections
    max_connections_per_peer: int = field(
        default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_CONNECTIONS_PER_PEER", 0)
    )
    header_timeout_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_HEADER_TIMEOUT_S", 10.0))
    body_timeout_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_BODY_TIMEOUT_S", 60.0))
    keep_alive_s: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_KEEP_ALIVE_S", 5.0))
    # requests of one namespace in flight on this gateway at once (tenant_share.TenantShare)
    max_requests_per_tenant: int = field(
        default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_REQUESTS_PER_TENANT", 256)
    )
    # work one request may ask for: n (samples), and n x max_tokens
    max_samples: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_SAMPLES", MAX_N))
    max_total_tokens: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_TOTAL_TOKENS", 32768))
    # bytes of stored responses (/v1/responses store, background) one namespace may hold at once
    max_stored_bytes: int = field(
        default_factory=lambda: _env_int("CONVEYOR_GATEWAY_MAX_STORED_BYTES", DEFAULT_MAX_STORED_BYTES)
    )
    # Host header names answered besides localhost and IP addresses ("a.example,*.b.example"; "*": any)
    allowed_hosts: str = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_ALLOWED_HOSTS", ""))
    # signed completion webhooks (docs/webhooks.md): the receiver of every served namespace
    # (a keys-file grant may name its own), the signing secret's file, and delivery pacing
    webhook_url: str | None = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_WEBHOOK_URL"))
    webhook_secret_file: str | None = field(default_factory=lambda: _env("CONVEYOR_GATEWAY_WEBHOOK_SECRET_FILE"))
    webhook_retry_for: float = field(
        default_factory=lambda: _env_float("CONVEYOR_GATEWAY_WEBHOOK_RETRY_FOR", 72 * 3600.0)
    )
    webhook_timeout: float = field(default_factory=lambda: _env_float("CONVEYOR_GATEWAY_WEBHOOK_TIMEOUT", 10.0))
    webhook_concurrency: int = field(default_factory=lambda: _env_int("CONVEYOR_GATEWAY_WEBHOOK_CONCURRENCY", 8))

    def __post_init__(self) -> None:
        if not NAMESPACE_PATTERN.fullmatch(self.namespace):
            raise ValueError(f"namespace must be {NAMESPACE_RULE}, got {self.namespace!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.model_cache_s < 0:
            raise ValueError(f"model_cache_s must be >= 0, got {self.model_cache_s}")
        for name in (
            "timeout_s",
            "replica_idle_s",
            "result_ttl",
            "max_body_bytes",
            "max_connections",
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_s",
            "max_total_tokens",
            "max_requests_per_tenant",
            "max_stored_bytes",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.max_samples <= MAX_N:
            raise ValueError(f"max_samples must be 1..{MAX_N}, got {self.max_samples}")
        HostPolicy(self.allowed_hosts, self.host)  # raises ValueError for a malformed entry
        if self.max_connections_per_peer < 0:
            raise ValueError(f"max_connections_per_peer must be >= 0, got {self.max_connections_per_peer}")
        if not self.max_connections_per_peer:
            self.max_connections_per_peer = max(1, self.max_connections * 3 // 4)
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.webhook_url:
            check_url(self.webhook_url, "--webhook-url (CONVEYOR_GATEWAY_WEBHOOK_URL)")
        check_pacing(self.webhook_retry_for, self.webhook_timeout, self.webhook_concurrency)
