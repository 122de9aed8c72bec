"""What a light client needs to know about a served model, published by each replica.

`<ns>:model:<name>` is a hash (see docs/protocol.md, "Model info") holding the model's
name, max_model_len, EOS ids, chat template, special tokens and tokenizer.json bytes with
their sha256, so producers count tokens exactly with `tokenizers` (TokenCounter), without
torch. `<ns>:models` is the set of published names. Both have a TTL: replicas republish.

Model info is input (any writer of the namespace may rewrite it): a fetch reads only the
known fields, each after its size was checked against FIELD_LIMITS, so a record over a
limit costs one ProtocolError for that model and never its bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from conveyor.clients.errors import ConveyorError, ProtocolError
from conveyor.clients.keys import Keys

MODEL_INFO_VERSION = 1
MODEL_INFO_TTL_S = 3600  # replicas republish well within it (MODEL_INFO_REPUBLISH_S)
MODEL_INFO_REPUBLISH_S = 600
DEFAULT_MODEL_WAIT_S = 300.0  # pipelines started with their replicas wait this long for a model
WAIT_POLL_S = 0.5
WAIT_PROGRESS_S = 5.0
MAX_CHAT_TEMPLATE_BYTES = 256 * 1024  # the largest published templates are a few tens of KiB
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # tokenizer.json of the largest vocabularies: ~35 MB
FIELD_LIMITS = {
    "v": 16,
    "name": 1024,
    "max_model_len": 32,
    "eos_token_ids": 64 * 1024,
    "chat_template": MAX_CHAT_TEMPLATE_BYTES,
    "special_tokens": 64 * 1024,
    "published_at": 64,
    "tokenizer_json": MAX_TOKENIZER_BYTES,
    "tokenizer_sha256": 64,
}
FIELDS = tuple(FIELD_LIMITS)


class ModelNotPublished(ConveyorError):
    """No (or no single) model info to use: no replica published one, or several did."""

    code = "model_not_published"


class SeveralModelsPublished(ModelNotPublished):
    """No model named and several are published: waiting would not help."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    tokenizer_json: bytes | None = field(default=None, repr=False)
    special_tokens: Mapping[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...
    published_at: float | None = None
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters a job may name in `lora` (conveyor serve --lora-modules)

    @property
    def tokenizer_sha256(self) -> str | None:
        return None if self.tokenizer_json is None else hashlib.sha256(self.tokenizer_json).hexdigest()

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @classmethod
    def from_hf_tokenizer(cls, name: str, max_model_len: int, eos_token_ids: Any, tokenizer: Any) -> ModelInfo:
        """From a transformers fast tokenizer (duck-typed: clients/ never imports transformers).

        Its backend tokenizer, not the file, so edits transformers makes on load (a BOS
        post-processor, say) are what clients count with.
        """
        return cls(
            name=name,
            max_model_len=int(max_model_len),
            eos_token_ids=tuple(sorted(int(t) for t in eos_token_ids)),
            chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
            tokenizer_json=tokenizer.backend_tokenizer.to_str().encode(),
            special_tokens=dict(tokenizer.special_tokens_map),
        )

    def to_fields(self) -> dict[str, str | bytes]:
        """Hash fields of `<ns>:model:<name>`."""
        fields: dict[str, str | bytes] = {
            "v": str(MODEL_INFO_VERSION),
            "name": self.name,
            "max_model_len": str(self.max_model_len),
            "eos_token_ids": json.dumps(list(self.eos_token_ids)),
            "chat_template": self.chat_template or "",
            "special_tokens": json.dumps(dict(self.special_tokens)),
            "published_at": repr(time.time() if self.published_at is None else self.published_at),
            "lora_adapters": json.dumps(list(self.lora_adapters)),
        }
        if self.tokenizer_json is not None:
            fields.update(tokenizer_json=self.tokenizer_json, tokenizer_sha256=self.tokenizer_sha256)
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> ModelInfo:
        text = {k.decode(): v for k, v in fields.items()}
        try:
            info = cls(
                name=text["name"].decode(),
                max_model_len=int(text["max_model_len"]),
                eos_token_ids=tuple(json.loads(text.get("eos_token_ids", b"[]"))),
                chat_template=text.get("chat_template", b"").decode() or None,
                tokenizer_json=text.get("tokenizer_json"),
                special_tokens=json.loads(text.get("special_tokens", b"{}")),
                published_at=float(text["published_at"]) if "published_at" in text else None,
                lora_adapters=adapter_names(text.get("lora_adapters")),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"model info is malformed: {type(exc).__name__}: {exc}") from None
        _check_sha256(info, text.get("tokenizer_sha256"))
        return info

    def token_counter(self) -> Any:
        """A TokenCounter (clients.token_counter) for this model."""
        from conveyor.clients.token_counter import TokenCounter  # imports tokenizers and jinja2: only when asked

        if self.tokenizer_json is None:
            raise ModelNotPublished(f"model {self.name!r}: its model info carries no tokenizer.json")
        try:
            return TokenCounter.from_json(self.tokenizer_json, self.chat_template, self.special_tokens)
        except Exception as exc:  # tokenizers' own errors for a tokenizer.json it cannot read
            raise ProtocolError(
                f"model info of {self.name!r}: tokenizer_json is unusable: {type(exc).__name__}"
            ) from None


MAX_ADAPTERS = 256
ADAPTER = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def adapter_names(raw: bytes | None) -> tuple[str, ...]:
    """The published adapter names (producer-writable: junk is none, names are checked, at most MAX_ADAPTERS)."""
    try:
        names = json.loads(raw) if raw else []
    except (ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(names, list):
        return ()
    return tuple(n for n in names[:MAX_ADAPTERS] if isinstance(n, str) and ADAPTER.match(n))


def _check_sha256(info: ModelInfo, published: bytes | None) -> None:
    if published is not None and info.tokenizer_sha256 != published.decode():
        raise ProtocolError(f"model info of {info.name!r}: tokenizer_json does not match its tokenizer_sha256")


# ---------------------------------------------------------------- publish


def queue_publish(pipe: Any, keys: Keys, info: ModelInfo, ttl_s: int = MODEL_INFO_TTL_S) -> None:
    """Queue the publish on a redis-py pipeline, sync or asyncio (use transaction=True)."""
    key = keys.model_info(info.name)
    pipe.delete(key)  # no field left over from an older publish
    pipe.hset(key, mapping=info.to_fields())
    pipe.expire(key, ttl_s)
    pipe.sadd(keys.models, info.name)
    pipe.expire(keys.models, ttl_s)


def publish_model_info(redis: Any, keys: Keys, info: ModelInfo, ttl_s: int = MODEL_INFO_TTL_S) -> None:
    pipe = redis.pipeline(transaction=True)
    queue_publish(pipe, keys, info, ttl_s)
    pipe.execute()


async def publish_model_info_async(redis: Any, keys: Keys, info: ModelInfo, ttl_s: int = MODEL_INFO_TTL_S) -> None:
    """What a replica awaits at start and every MODEL_INFO_REPUBLISH_S (redis.asyncio client)."""
    async with redis.pipeline(transaction=True) as pipe:
        queue_publish(pipe, keys, info, ttl_s)
        await pipe.execute()


# ---------------------------------------------------------------- fetch


def fetch_model_info(redis: Any, keys: Keys, name: str | None = None) -> ModelInfo:
    """Model info of `name`, or of the only published model when `name` is None."""
    if name is None:
        members = sorted(redis.smembers(keys.models))
        pipe = redis.pipeline(transaction=False)
        for member in members:
            pipe.exists(keys.model_info(member.decode()))
        name = only_model(keys, members, pipe.execute())
    key = keys.model_info(name)
    pipe = redis.pipeline(transaction=False)
    for field_name in FIELDS:
        pipe.hstrlen(key, field_name)
    check_sizes(name, pipe.execute())
    return model_info_from(keys, name, known_fields(redis.hmget(key, FIELDS)))


async def fetch_model_info_async(redis: Any, keys: Keys, name: str | None = None) -> ModelInfo:
    if name is None:
        members = sorted(await redis.smembers(keys.models))
        pipe = redis.pipeline(transaction=False)
        for member in members:
            pipe.exists(keys.model_info(member.decode()))
        name = only_model(keys, members, await pipe.execute())
    key = keys.model_info(name)
    pipe = redis.pipeline(transaction=False)
    for field_name in FIELDS:
        pipe.hstrlen(key, field_name)
    check_sizes(name, await pipe.execute())
    return model_info_from(keys, name, known_fields(await redis.hmget(key, FIELDS)))


def check_sizes(name: str, sizes: list[int]) -> None:
    """ProtocolError naming the first field of the model info over its FIELD_LIMITS entry."""
    for field_name, size in zip(FIELDS, sizes):
        if size > FIELD_LIMITS[field_name]:
            raise ProtocolError(
                f"model info of {name[:200]!r}: {field_name} is {size} bytes, over the limit of "
                f"{FIELD_LIMITS[field_name]}"
            )


def known_fields(values: list[bytes | None]) -> dict[bytes, bytes]:
    """HMGET's answer as the hash of the known fields that are set; sizes checked again (a
    rewrite between the two reads costs this read, not the next)."""
    fields = {name.encode(): value for name, value in zip(FIELDS, values) if value is not None}
    check_sizes(fields.get(b"name", b"?").decode("utf-8", "replace"), [len(v or b"") for v in values])
    return fields


def only_model(keys: Keys, members: list[bytes], exists: list[int]) -> str:
    live = [m.decode() for m, alive in zip(members, exists) if alive]
    if not live:
        raise ModelNotPublished(
            f"no model info published in namespace {keys.ns!r} ({keys.models} is empty): "
            "start a replica (it publishes its model) or check --namespace"
        )
    if len(live) > 1:
        raise SeveralModelsPublished(f"several models are published ({', '.join(live)}): name one with model=...")
    return live[0]


def model_info_from(keys: Keys, name: str, fields: Mapping[bytes, bytes]) -> ModelInfo:
    if not fields:
        raise ModelNotPublished(f"no model info for {name!r} at {keys.model_info(name)}: no replica serves it")
    return ModelInfo.from_fields(fields)


# ---------------------------------------------------------------- wait


def wait_for_model_info(redis: Any, keys: Keys, model: str | None, wait_s: float, progress: bool = True) -> ModelInfo:
    """fetch_model_info, polled until a replica publishes the model or `wait_s` runs out.

    For pipelines started together with their replicas (a compose deployment): a replica
    publishes its model info once the model is loaded. `model` None waits for any one
    model. Prints a progress line to stderr every WAIT_PROGRESS_S unless `progress` is
    False. Raises ModelNotPublished naming the limit after `wait_s` (0: one look, the
    fetch's own error), and at once when several models are published and none is named.
    """
    wait = _Wait(keys, model, wait_s, progress)
    while True:
        try:
            return fetch_model_info(redis, keys, model)
        except ModelNotPublished as exc:
            time.sleep(wait.pause_after(exc))


async def wait_for_model_info_async(
    redis: Any, keys: Keys, model: str | None, wait_s: float, progress: bool = True
) -> ModelInfo:
    """wait_for_model_info on a redis.asyncio client."""
    wait = _Wait(keys, model, wait_s, progress)
    while True:
        try:
            return await fetch_model_info_async(redis, keys, model)
        except ModelNotPublished as exc:
            await asyncio.sleep(wait.pause_after(exc))


class _Wait:
    """The clock of one wait for model info: when to poll again, report, give up."""

    def __init__(self, keys: Keys, model: str | None, wait_s: float, progress: bool) -> None:
        if math.isnan(wait_s) or wait_s < 0:
            raise ValueError(f"wait_s must be >= 0 seconds, got {wait_s!r}")
        self.keys, self.model, self.wait_s, self.progress = keys, model, float(wait_s), progress
        self.started = time.monotonic()
        self.next_report = self.started

    def pause_after(self, miss: ModelNotPublished) -> float:
        """Seconds until the next poll after `miss`; raises when waiting is over."""
        if isinstance(miss, SeveralModelsPublished) or self.wait_s == 0:
            raise miss
        now = time.monotonic()
        waited = now - self.started
        if waited >= self.wait_s:
            raise ModelNotPublished(
                f"no replica published {self._what()} within the wait limit of {self.wait_s:g} s "
                f"(wait_s, --wait-s): {miss.message}"
            ) from None
        if self.progress and now >= self.next_report:
            print(f"waiting for {self._who()} ({waited:.0f} s of {self.wait_s:g} s)", file=sys.stderr, flush=True)
            self.next_report = now + WAIT_PROGRESS_S
        return min(WAIT_POLL_S, self.wait_s - waited)

    def _what(self) -> str:
        return f"model {self.model!r}" if self.model else f"any model info in namespace {self.keys.ns!r}"

    def _who(self) -> str:
        if self.model:
            return f"a replica serving model {self.model!r} in namespace {self.keys.ns!r}"
        return f"a replica to publish its model in namespace {self.keys.ns!r}"
