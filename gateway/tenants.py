"""Who is asking: API keys -> tenants (a namespace and a priority class), and each
namespace's state (one AsyncClient on the shared Redis connection, its served models).

Keys come from a file (`--keys-file`, JSON or YAML: `{"<key>": {"namespace": "team-a",
"priority_class": "batch", "admin": false}}`, or `"<key>": "team-a:batch"`; `admin: true`
lets the key open the dashboard of every configured namespace and act there; `webhook_url` and
`webhook_secret_file` send the namespace's webhook events elsewhere than the gateway's
--webhook-url, docs/webhooks.md) and/or the environment
(`CONVEYOR_GATEWAY_API_KEYS="key1=team-a,key2=team-b:batch"`). With no key configured,
requests need no `Authorization` and all use the gateway's `--namespace`, class
interactive. Keys are kept only as SHA-256 digests, compared in constant time, never logged.

A key's class caps what its requests get: a `batch` key always submits batch jobs; an
`interactive` key (the default) may ask for batch with `service_tier: "flex"` or the
header `X-Conveyor-Priority-Class: batch`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from fastapi import Request

from conveyor.apps.openai_api.errors import OpenAIError
from conveyor.clients.async_client import AsyncClient
from conveyor.clients.errors import ConveyorError
from conveyor.clients.keys import GROUP, NAMESPACE_PATTERN, NAMESPACE_RULE, PRIORITY_CLASSES, Keys
from conveyor.clients.model_info import adapter_names, fetch_model_info_async
from conveyor.gateway.webhook_config import check_url

INTERACTIVE, BATCH = PRIORITY_CLASSES
log = logging.getLogger("conveyor.gateway")
MAX_MODELS = 256  # names read from <ns>:models per look
EXAMPLE_KEY = "REPLACE-ME"  # compose/gateway_keys.json.example's placeholder


# ---------------------------------------------------------------- API keys


@dataclass(frozen=True)
class Grant:
    """What one API key gives: its namespace and the best priority class it may use."""

    namespace: str
    priority_class: str = INTERACTIVE
    admin: bool = False  # the dashboard: every configured namespace, and its actions
    # the namespace's webhook receiver and secret instead of the gateway's (webhook_config.py)
    webhook_url: str | None = None
    webhook_secret_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.admin, bool):
            raise ValueError(f"admin must be true or false, got {self.admin!r}")
        if self.webhook_url is not None:
            check_url(self.webhook_url, "webhook_url")
        if self.webhook_secret_file is not None and not (
            isinstance(self.webhook_secret_file, str) and 0 < len(self.webhook_secret_file) <= 4096
        ):
            raise ValueError("webhook_secret_file must be a file path (a non-empty string)")
        if not isinstance(self.namespace, str) or not NAMESPACE_PATTERN.fullmatch(self.namespace):
            raise ValueError(f"namespace must be {NAMESPACE_RULE}, got {self.namespace!r}")
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {self.priority_class!r}")


class KeyRing:
    """SHA-256 of each key -> its grant. Every lookup compares with every key (no early
    exit) through hmac.compare_digest, so timing tells nothing about which key is close."""

    def __init__(self, grants: dict[str, Grant]) -> None:
        self._digests = [(_digest(key), grant) for key, grant in grants.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def namespaces(self) -> list[str]:
        return sorted({grant.namespace for _, grant in self._digests})

    def grant_for(self, key: str) -> Grant | None:
        presented, found = _digest(key), None
        for digest, grant in self._digests:
            if hmac.compare_digest(digest, presented):
                found = grant
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def load_grants(keys_file: str | None, api_keys: str | None) -> dict[str, Grant]:
    """Keys of the file, then of the env list (which wins for a key given in both). A
    source that is given but holds no key is an error: it would silently turn auth off."""
    grants = read_keys_file(keys_file) if keys_file else {}
    listed = parse_key_list(api_keys or "")
    if (keys_file and not grants) or (api_keys and api_keys.strip() and not listed):
        raise ValueError("API keys were configured but none could be read: refusing to run without auth")
    if any(EXAMPLE_KEY in key for key in {**grants, **listed}):
        raise ValueError("an API key is still the example's (REPLACE-ME...): make one, e.g. openssl rand -hex 24")
    return {**grants, **listed}


def parse_key_list(text: str) -> dict[str, Grant]:
    """ "key1=ns1,key2=ns2:batch" -> grants. Errors never quote a key."""
    grants = {}
    for number, item in enumerate(filter(None, (part.strip() for part in text.split(","))), 1):
        key, sep, target = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"CONVEYOR_GATEWAY_API_KEYS item {number}: expected key=namespace[:class]")
        grants[key.strip()] = _grant(target.strip(), f"CONVEYOR_GATEWAY_API_KEYS item {number}")
    return grants


def read_keys_file(path: str | Path) -> dict[str, Grant]:
    text = Path(path).read_text(encoding="utf-8")
    data = _parse_yaml(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"keys file {path}: expected a mapping of key -> {{namespace, priority_class}}")
    return {
        str(key): _grant(value, f"keys file {path}, entry {number}")
        for number, (key, value) in enumerate(data.items(), 1)
    }


def _parse_yaml(text: str) -> Any:
    import yaml  # only for YAML key files

    return yaml.safe_load(text)


def _grant(value: Any, where: str) -> Grant:
    try:
        if isinstance(value, str):
            namespace, _, priority_class = value.partition(":")
            return Grant(namespace, priority_class or INTERACTIVE)
        if isinstance(value, dict):
            return Grant(
                value.get("namespace"),
                value.get("priority_class") or INTERACTIVE,
                value.get("admin", False),
                value.get("webhook_url"),
                value.get("webhook_secret_file"),
            )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where}: expected 'namespace[:class]' or {{namespace, priority_class}}")


# ---------------------------------------------------------------- models of a namespace


@dataclass(frozen=True)
class ServedModel:
    """A published model and how recently a replica serving it was seen."""

    name: str
    max_model_len: int
    published_at: float
    tokenizer_sha256: str | None
    idle_s: float | None  # since a replica of it last touched a request stream; None: never seen
    template_bytes: int = 0  # of its chat template: with the sha, when to fetch the model info again
    adapters: tuple[str, ...] = ()  # its LoRA adapters (a request's model may name one)

    @property
    def version(self) -> tuple:
        """What changes when the model info is rewritten (by a new model, or by any writer of the namespace)."""
        return self.tokenizer_sha256, self.template_bytes

    def live(self, replica_idle_s: float) -> bool:
        return self.idle_s is not None and self.idle_s <= replica_idle_s


class ModelDirectory:
    """The models of one namespace, looked up at most every `cache_s`.

    Liveness rule: a model is *published* while its model info hash `<ns>:model:<name>`
    exists (replicas republish it every 10 minutes with a 1 hour TTL), and *live* while
    also some consumer of its own request streams (`<ns>:requests:<class>:<name>`: only its
    replicas read them) touched one of the streams its replicas read within
    `replica_idle_s` (XINFO CONSUMERS `idle`: an idle replica polls at least every second, a busy
    one renews its leases with XCLAIM every lease/3). A killed replica's model stays
    published for up to an hour, but stops being live within `replica_idle_s`.
    """

    def __init__(self, client: AsyncClient, replica_idle_s: float, cache_s: float) -> None:
        self.client = client
        self.replica_idle_s = replica_idle_s
        self.cache_s = cache_s
        self._models: dict[str, ServedModel] = {}
        self._looked_at = float("-inf")
        self._looking = asyncio.Lock()  # one look at a time; the others reuse it
        self._counters: dict[str, tuple[str | None, Any]] = {}  # name -> (tokenizer sha, TokenCounter)

    async def published(self) -> dict[str, ServedModel]:
        async with self._looking:
            if time.monotonic() - self._looked_at > self.cache_s:
                self._models = await self._look()
                self._looked_at = time.monotonic()
        return self._models

    async def live(self) -> list[ServedModel]:
        return [m for m in (await self.published()).values() if m.live(self.replica_idle_s)]

    async def require(self, name: str) -> ServedModel:
        """The live model `name`; 404 when this namespace publishes no such model, 503 when
        none at all (no replica ever started here) or no replica of it is alive."""
        models = await self.published()
        model = models.get(name)
        if model is None and models:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist (served here: {', '.join(sorted(models))})",
                param="model",
                code="model_not_found",
            )
        if model is None:
            raise OpenAIError(
                503,
                f"no replica serves model `{name}`: none has published a model in this namespace",
                param="model",
                code="no_replica",
            )
        if not model.live(self.replica_idle_s):
            seen = "never" if model.idle_s is None else f"{model.idle_s:.0f} s ago"
            raise OpenAIError(
                503, f"no live replica serves model `{name}` (last seen {seen})", param="model", code="no_replica"
            )
        return model

    async def token_counter(self, model: ServedModel) -> Any:
        """A TokenCounter (clients.token_counter) with the model's tokenizer, fetched once
        per version of the model info. Raises ModelNotPublished when the model info carries
        none, ProtocolError when it is unusable: remembered too, so a bad record costs one
        fetch per rewrite, not one per request."""
        version, counter = self._counters.get(model.name, (None, None))
        if counter is None or version != model.version:
            try:
                info = await fetch_model_info_async(self.client.redis, self.client.keys, model.name)
                counter = await asyncio.to_thread(info.token_counter)  # parsing tokenizer.json takes a while
            except ConveyorError as exc:
                counter = exc
            self._counters[model.name] = (model.version, counter)
        if isinstance(counter, ConveyorError):
            raise counter.with_traceback(None)  # the remembered error, without the tracebacks of earlier raises
        return counter

    async def context_left(self, name: str, messages: list[dict]) -> int | None:
        """max_tokens for a chat that names none: the context its prompt leaves, as OpenAI
        and vLLM give (counted with the model's published tokenizer and chat template).
        None when it cannot be counted: the job keeps its default and the replica judges."""
        model = (await self.published()).get(name)
        if model is None:
            return None
        try:
            counter = await self.token_counter(model)
            used = await asyncio.to_thread(counter.checked_count_chat, messages)  # big prompts: off the event loop
        except Exception as exc:  # no tokenizer or chat template, a template that fails or is refused
            log.debug("cannot count the chat prompt for %s: %s", name, exc)
            return None
        return max(1, min(model.max_model_len - used, await self._max_tokens_cap()))

    async def _max_tokens_cap(self) -> int:
        """The replicas' --max-tokens-cap, published in <ns>:limits (producer-writable: junk is no cap)."""
        try:
            value = int(await self.client.redis.hget(self.client.keys.limits, "max_tokens_cap") or 0)
        except (ValueError, TypeError, redis.RedisError):
            return 2**31 - 1
        return value if value > 0 else 2**31 - 1

    async def _look(self) -> dict[str, ServedModel]:
        keys, redis = self.client.keys, self.client.redis
        # the set is input (any producer of the namespace may write it): a bounded sample, sane names only
        members = await redis.srandmember(keys.models, MAX_MODELS)
        names = sorted({n for n in (m.decode("utf-8", "replace") for m in members) if 0 < len(n) <= 256})
        sizes = await _field_sizes(redis, [keys.model_info(name) for name in names])
        # an oversized field (junk a producer wrote) is never read: it counts as missing
        reads = [
            (i, field) for i, size in enumerate(sizes) for field in SMALL_FIELDS if size[field] <= MAX_SMALL_FIELD_BYTES
        ]
        pipe = redis.pipeline(transaction=False)
        for i, field in reads:
            pipe.hget(keys.model_info(names[i]), field)
        streams = [*keys.all_requests, *(s for name in names for s in keys.all_model_requests(name))]
        for stream in streams:
            pipe.xinfo_consumers(stream, GROUP)
        replies = await pipe.execute(raise_on_error=False)
        infos = [dict.fromkeys(SMALL_FIELDS) for _ in names]
        for (i, field), value in zip(reads, replies):
            infos[i][field] = value if isinstance(value, bytes) else None
        consumers = dict(zip(streams, replies[len(reads) :]))
        return {
            model.name: model
            for model in (
                _served(keys, name, info, size["chat_template"], consumers)
                for name, info, size in zip(names, infos, sizes)
            )
            if model
        }


SMALL_FIELDS = ("max_model_len", "published_at", "tokenizer_sha256", "lora_adapters")
MAX_SMALL_FIELD_BYTES = 16 * 1024  # far above any real value of these fields


async def _field_sizes(redis, model_keys: list[str]) -> list[dict[str, int]]:
    """HSTRLEN of each model record's small fields and of its chat template, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    measured = (*SMALL_FIELDS, "chat_template")
    for key in model_keys:
        for field in measured:
            pipe.hstrlen(key, field)
    replies = await pipe.execute(raise_on_error=False)
    sizes = [v if isinstance(v, int) else 0 for v in replies]
    return [dict(zip(measured, sizes[i * len(measured) : (i + 1) * len(measured)])) for i in range(len(model_keys))]


def _served(
    keys: Keys, name: str, info: dict[str, bytes | None], template_bytes: int, consumers: dict[str, Any]
) -> ServedModel | None:
    if info["max_model_len"] is None:
        return None  # expired (or never a hash, or junk): not published
    try:
        max_model_len, published_at = int(info["max_model_len"]), float(info["published_at"] or 0)
    except ValueError:
        return None  # unreadable model info: as good as none
    sha = info["tokenizer_sha256"].decode("ascii", "replace") if info["tokenizer_sha256"] else None
    return ServedModel(
        name,
        max_model_len,
        published_at,
        sha,
        _idle_s(keys, name, consumers),
        template_bytes,
        adapter_names(info["lora_adapters"]),
    )


def _idle_s(keys: Keys, name: str, consumers: dict[str, Any]) -> float | None:
    """Seconds since the most recently seen replica of `name` touched any stream it reads."""
    own = {c["name"] for s in keys.all_model_requests(name) for c in _rows(consumers[s])}
    streams = [*keys.all_requests, *keys.all_model_requests(name)]
    idle = [int(c["idle"]) for s in streams for c in _rows(consumers[s]) if c["name"] in own]
    return min(idle) / 1000 if idle else None


def _rows(reply: Any) -> list[dict]:
    return reply if isinstance(reply, list) else []  # no stream or group yet: nobody reads it


# ---------------------------------------------------------------- tenants


class Namespaces:
    """One AsyncClient and ModelDirectory per namespace, all on one Redis client (one
    connection pool). Namespaces come only from the configured keys: the cache is bounded."""

    def __init__(self, redis: Any, replica_idle_s: float, cache_s: float, partitions: int | None = None) -> None:
        self.redis = redis
        self.partitions = partitions  # of the cluster layout (the redis client says whether it is one)
        self.replica_idle_s = replica_idle_s
        self.cache_s = cache_s
        self._clients: dict[str, AsyncClient] = {}
        self._models: dict[str, ModelDirectory] = {}

    def client(self, namespace: str) -> AsyncClient:
        if namespace not in self._clients:
            self._clients[namespace] = AsyncClient(
                namespace=namespace, redis_client=self.redis, partitions=self.partitions
            )
        return self._clients[namespace]

    def models(self, namespace: str) -> ModelDirectory:
        if namespace not in self._models:
            self._models[namespace] = ModelDirectory(self.client(namespace), self.replica_idle_s, self.cache_s)
        return self._models[namespace]


@dataclass(frozen=True)
class Tenant:
    """The caller of one request: its namespace and the best class it may use."""

    namespace: str
    priority_class: str
    namespaces: Namespaces

    @property
    def client(self) -> AsyncClient:
        return self.namespaces.client(self.namespace)

    @property
    def models(self) -> ModelDirectory:
        return self.namespaces.models(self.namespace)

    def priority_for(self, requested: str | None) -> str:
        """The class a job gets: what was asked for (default interactive), capped by the key's."""
        if requested is not None and requested not in PRIORITY_CLASSES:
            raise OpenAIError(
                400,
                f"priority class must be one of {PRIORITY_CLASSES}, got {requested!r}",
                param="priority_class",
                code="invalid_value",
            )
        return BATCH if BATCH in (requested, self.priority_class) else INTERACTIVE


def tenant_of(request: Request) -> Tenant:
    """FastAPI dependency: the tenant of the request's `Authorization: Bearer <key>`
    (401 without a known key), or the default tenant when no key is configured."""
    state = request.app.state
    if not state.keyring.enabled:
        return Tenant(state.settings.namespace, INTERACTIVE, state.namespaces)
    key = bearer_token(request.headers.get("authorization"))
    if key is None:
        raise OpenAIError(
            401, "You didn't provide an API key: send it as 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    grant = state.keyring.grant_for(key)
    if grant is None:
        raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return Tenant(grant.namespace, grant.priority_class, state.namespaces)


def bearer_token(header: str | None) -> str | None:
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
