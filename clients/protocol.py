"""Wire protocol: the job schema (JobRequest), its stream-entry codec, and the events.

A request-stream entry carries the job in one field: `data` (msgpack map) or `json`
(a JSON object, handy for `redis-cli XADD ... json '{"prompt": "hi"}'`).
"""

from __future__ import annotations

import decimal
import hashlib
import json
import math
import uuid
import warnings
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from conveyor.clients.errors import InvalidJob, ProtocolError
from conveyor.clients.events import (  # noqa: F401  (re-exported: events are part of the protocol)
    EVENT_TYPES,
    TERMINAL_TYPES,
    CancelledEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    OutputChoice,
    TerminalEvent,
    Timings,
    TokenEvent,
    Usage,
    decode_event,
    decode_event_data,
    encode_event,
    encode_event_data,
)
from conveyor.clients.limits import (  # noqa: F401  (re-exported)
    EARLIEST_DEADLINE,
    INT32_MAX,
    JOB_ID_PATTERN,
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_DECODED_ELEMENTS,
    MAX_JSON_BYTES,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_MSGPACK_BYTES,
    MAX_N,
    MAX_PENALTY,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_RESULT_TTL,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_STRUCTURED_BYTES,
    MAX_TEMPERATURE,
    MAX_TRACESTATE_CHARS,
    MIN_PENALTY,
    MIN_REPETITION_PENALTY,
    SCHEMA_VERSION,
    SEED_MAX,
    SEED_MIN,
    TRACEPARENT_PATTERN,
    TRACESTATE_PATTERN,
)
from conveyor.clients.safe_payload import read_payload, readable_job_id  # noqa: F401
from conveyor.clients.tool_schema import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MessageToolCall,
    ToolChoice,
    ToolSpec,
    check_tools,
    tool_choice_of,
)

ADAPTER_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]


class FieldValueError(ValueError):
    """A ValueError that knows which field it is about (for cross-field checks)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str = Field(min_length=1, max_length=64)
    tool_calls: list[MessageToolCall] | None = Field(default=None, min_length=1, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=128)  # a `tool` message: the call it answers
    # None only for an assistant's tool calls (fields are validated in order: tool_calls first)
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_assistant(cls, value: list | None, info: ValidationInfo) -> list | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not {info.data.get('role')!r}")
        return value

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required (only an assistant message with tool_calls may omit content)")
        return value

    def size(self) -> int:
        """Characters that count against MAX_PROMPT_CHARS: content and call arguments."""
        return len(self.content or "") + sum(len(call.function.arguments) for call in self.tool_calls or [])


STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


with warnings.catch_warnings():  # the field `json` (vLLM's name) shadows BaseModel.json(), deprecated and unused
    warnings.filterwarnings("ignore", message='Field name "json"', category=UserWarning)

    class StructuredOutputs(BaseModel):
        """vLLM's StructuredOutputsParams: exactly one constraint. Unknown keys are an error
        here (each would change the output; ignoring one would silently loosen the constraint)."""

        model_config = ConfigDict(strict=True, extra="forbid")

        json: dict[str, Any] | str | None = None  # a JSON schema, as an object or its text
        regex: str | None = None
        choice: list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]] | None = Field(
            default=None, min_length=1, max_length=MAX_CHOICES
        )
        grammar: str | None = None  # EBNF (GBNF) as xgrammar reads it, start rule `root`
        json_object: Literal[True] | None = None  # any JSON object
        disable_any_whitespace: bool = False  # vLLM's name: compact JSON, now the default anyway
        # json, json_object: compact (None: the default; hashed only when given) or any whitespace
        whitespace: Literal["compact", "any"] | None = None

        _json_size = field_validator("json", mode="before")(lambda cls, value: _schema_size(value))
        _text_size = field_validator("regex", "grammar")(lambda cls, value: _structured_size(value))
        _choices_size = field_validator("choice")(lambda cls, value: _choices_size(value))
        _exactly_one = model_validator(mode="after")(lambda self: _exactly_one_constraint(self))


def _schema_size(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return _structured_size(value)
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON schema: an object or its text (got {type(value).__name__})")
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"must be plain JSON ({exc})") from None
    _structured_size(text)
    return value


def _structured_size(text: str | None) -> str | None:
    size = 0 if text is None else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_STRUCTURED_BYTES:
        raise ValueError(f"is {size} bytes, limit {MAX_STRUCTURED_BYTES}")
    return text


def _choices_size(value: list[str] | None) -> list[str] | None:
    total = sum(len(choice.encode("utf-8", "surrogatepass")) for choice in value or [])
    if total > MAX_STRUCTURED_BYTES:
        raise ValueError(f"the choices are {total} bytes in all, limit {MAX_STRUCTURED_BYTES}")
    return value


def _exactly_one_constraint(so: StructuredOutputs) -> StructuredOutputs:
    given = [name for name in STRUCTURED_CONSTRAINTS if getattr(so, name) is not None]
    if len(given) != 1:
        raise ValueError(
            f"exactly one of {', '.join(STRUCTURED_CONSTRAINTS)} is required (got {', '.join(given) or 'none'})"
        )
    if so.whitespace == "any" and so.disable_any_whitespace:
        raise ValueError("whitespace: any contradicts disable_any_whitespace: true")
    return so


class JobRequest(BaseModel):
    """One generation job. Sampling fields use vLLM SamplingParams names and defaults."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    v: int = Field(default=SCHEMA_VERSION, ge=1, le=SCHEMA_VERSION)
    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=JOB_ID_PATTERN)
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    prompt_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    # "auto": the replica sends `prompt` through the model's chat template, as one user
    # message, when the model has one (else as it is): decided where the model is known
    chat_template: Literal["auto"] | None = None

    max_tokens: int = Field(default=16, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(default=1, ge=1, le=MAX_N)  # outputs: sampled side by side, sharing the prompt's KV
    structured_outputs: StructuredOutputs | None = None
    tools: list[ToolSpec] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)  # chat jobs only
    tool_choice: ToolChoice | None = None  # default with tools: "auto"
    parallel_tool_calls: bool = True

    priority_class: Literal["interactive", "batch"] = "interactive"
    priority: Int32 = 0
    deadline: float | None = Field(default=None, gt=0.0)
    result_ttl: int = Field(default=86_400, ge=1, le=MAX_RESULT_TTL)
    metadata: dict[str, Any] = Field(default_factory=dict)
    model: str | None = Field(default=None, min_length=1, max_length=256)
    lora: str | None = Field(default=None, pattern=ADAPTER_NAME)  # a LoRA adapter the replica serves (--lora-modules)
    # vLLM's cache_salt: prefix-cache entries are shared only between jobs of one salt (and,
    # on a replica, of one namespace whatever the salt)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # the producer's span (W3C Trace Context): the replica's spans of this job continue it
    # (actors/tracing.py); only its syntax is trusted, and it is no part of the digest
    traceparent: str | None = Field(default=None, max_length=55, pattern=TRACEPARENT_PATTERN)
    tracestate: str | None = Field(default=None, max_length=MAX_TRACESTATE_CHARS, pattern=TRACESTATE_PATTERN)
    # ask for job.completed / job.failed webhook events, sent to the address the operator
    # configured for the namespace (never one the job names)
    webhook: bool = False

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_total(cls, value: list[str]) -> list[str]:
        total = sum(len(stop) for stop in value)
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_TOTAL_CHARS} characters in all, got {total}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_off_is_zero(cls, value: int) -> int:
        return 0 if value == -1 else value

    @field_validator("messages")
    @classmethod
    def _messages_size(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value and sum(m.size() for m in value) > MAX_PROMPT_CHARS:
            raise ValueError(f"total content must be at most {MAX_PROMPT_CHARS} characters")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return tool_choice_of(value)

    @field_validator("deadline")
    @classmethod
    def _deadline_is_absolute(cls, value: float | None) -> float | None:
        if value is not None and value < EARLIEST_DEADLINE:
            raise ValueError(f"must be absolute epoch seconds (e.g. time.time() + 30), got {value}")
        return value

    @field_validator("traceparent")
    @classmethod
    def _trace_ids_set(cls, value: str | None) -> str | None:
        if value is not None and any(set(part) == {"0"} for part in value.split("-")[1:3]):
            raise ValueError("trace-id and parent-id must not be all zeros (W3C Trace Context)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(msgpack.packb(value, use_bin_type=True))
        except Exception as exc:
            raise ValueError(f"must be msgpack/JSON serialisable ({exc})") from None
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"encodes to {size} bytes, limit {MAX_METADATA_BYTES}")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobRequest:
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise FieldValueError(
                given[1] if len(given) > 1 else "prompt",
                f"exactly one of prompt, messages, prompt_token_ids is required (got {got})",
            )
        if self.chat_template is not None and self.prompt is None:
            raise FieldValueError("chat_template", "chat_template applies to a `prompt` (messages always use it)")
        self._check_tools()
        if self.min_tokens > self.max_tokens:
            raise FieldValueError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self

    def _check_tools(self) -> None:
        if self.tools is None and self.tool_choice is None:
            return
        if self.messages is None:
            raise FieldValueError("tools" if self.tools else "tool_choice", "tools need a chat job (messages)")
        problem = check_tools(self.tools, self.tool_choice)
        if problem:
            field, message = problem.split(": ", 1)
            raise FieldValueError(field, message)
        forced = self.tool_choice not in (None, "none", "auto")
        if forced and self.structured_outputs is not None:
            raise FieldValueError(
                "tool_choice",
                "a forced tool call is its own structured output: "
                "give tool_choice required/named or structured_outputs, not both",
            )

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """`messages` as plain dicts (for a tokenizer's chat template), unset fields left out."""
        return None if self.messages is None else [m.model_dump(exclude_none=True) for m in self.messages]

    def tools_given(self) -> dict[str, Any] | None:
        """tools, tool_choice and parallel_tool_calls as plain JSON (None when the job has no tools)."""
        if self.tools is None:
            return None
        choice = self.tool_choice
        return {
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools],
            "tool_choice": choice if isinstance(choice, str) or choice is None else choice.model_dump(),
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def sampling_params(self) -> dict[str, Any]:
        """Keyword arguments for vLLM-style `SamplingParams(**job.sampling_params())`
        (`structured_outputs` as a plain dict of its given fields, or None)."""
        params = {name: _copy(getattr(self, name)) for name in (*SAMPLING_PARAM_NAMES, *DEFAULT_ONLY_DIGEST_FIELDS)}
        params["structured_outputs"] = self.structured_outputs_given()
        return params

    def structured_outputs_given(self) -> dict[str, Any] | None:
        """`structured_outputs` without its unset and default entries (None when absent)."""
        so = self.structured_outputs
        return None if so is None else so.model_dump(exclude_defaults=True)


SAMPLING_PARAM_NAMES = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logprobs",
)
# Sampling fields a job may leave unset: the replica then uses the served model's default
# (its generation_config.json, as vLLM's --generation-config auto), else JobRequest's. Which
# ones a job set is pydantic's `model_fields_set`: the keys of the payload it was read from.
# The digest hashes JobRequest's default for an unset one, as it always did.
MODEL_DEFAULT_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Fields added after the digest was defined: part of it only when not at their default, so
# every digest computed before them stays valid (docs/protocol.md, "Payload digest").
DEFAULT_ONLY_DIGEST_FIELDS = {"n": 1}


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


# ---------------------------------------------------------------- validation


def validate_job(payload: Any) -> JobRequest:
    """JobRequest from a plain dict; raises InvalidJob naming the field and the limit."""
    if not isinstance(payload, dict):
        raise InvalidJob(f"job must be a map/object, got {type(payload).__name__}", field="job")
    try:
        return JobRequest.model_validate(payload)
    except ValidationError as exc:
        raise invalid_job_from(exc, readable_job_id(payload)) from None


def invalid_job_from(exc: ValidationError, job_id: str | None) -> InvalidJob:
    problems = [_describe(err) for err in exc.errors(include_url=False)]
    message = "invalid job: " + "; ".join(f"{field}: {msg}" for field, msg in problems)
    return InvalidJob(message, field=problems[0][0], problems=problems, job_id=job_id)


def _describe(err: dict) -> tuple[str, str]:
    cause = (err.get("ctx") or {}).get("error")
    field = getattr(cause, "field", None) or _format_loc(err["loc"]) or "job"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] not in ("value_error", "missing"):
        msg += f" (got {_short_repr(err.get('input'))})"
    return field, msg


def _format_loc(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _short_repr(value: Any, limit: int = 60) -> str:
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------- stream-entry codec


def encode_job(job: JobRequest) -> dict[str, bytes]:
    """Request-stream entry fields for `job`: {"data": msgpack bytes}. The sampling fields
    of MODEL_DEFAULT_FIELDS that the producer left unset stay out, so the replica gives them
    the served model's defaults (an older replica, JobRequest's: the same values as before)."""
    unset = {name for name in MODEL_DEFAULT_FIELDS if name not in job.model_fields_set}
    return {"data": msgpack.packb(job.model_dump(exclude=unset), use_bin_type=True)}


def decode_job(fields: dict, entry_id: str | bytes | None = None) -> JobRequest:
    """Decode a request-stream entry; raises only ProtocolError (InvalidJob is one).

    A payload without `job_id` gets the stream `entry_id` (when given) as its job id, so
    a producer that only ran `XADD` can find `<ns>:out:<entry id>`.
    """
    try:
        payload = read_payload(fields)
        if "job_id" not in payload and entry_id is not None:
            payload["job_id"] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        _check_version(payload)
        return validate_job(payload)
    except ProtocolError:
        raise
    except Exception as exc:  # a bug or a hostile corner case: still a ProtocolError
        raise ProtocolError(f"could not decode job: {type(exc).__name__}: {exc}") from None


def _check_version(payload: dict) -> None:
    version = payload.get("v", SCHEMA_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ProtocolError(
            f"v: schema version {version} is newer than this build understands ({SCHEMA_VERSION})",
            code="unsupported_version",
            job_id=readable_job_id(payload),
        )


# ---------------------------------------------------------------- payload digest
#
# Language-neutral: SHA-256 (lowercase hex, 64 characters) of the canonical JSON of the
# fields that decide a job's output, defaults filled in. docs/protocol.md ("Payload
# digest") defines it, with a JavaScript reference and test vectors.

DIGEST_FIELDS = ("prompt", "messages", "prompt_token_ids", "model", *SAMPLING_PARAM_NAMES)
# hashed only when given (tools: all three): older digests stay valid
OPTIONAL_DIGEST_FIELDS = (
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "lora",
    "chat_template",
    "cache_salt",
)


def payload_digest(job: JobRequest) -> str:
    """What the job asks for, hashed: the same job_id with another digest is a conflict.
    Scheduling and delivery (priority_class, priority, deadline, result_ttl), job_id,
    metadata, `v`, the trace context and `webhook` are not part of it."""
    return hashlib.sha256(digest_input(job).encode("ascii")).hexdigest()


def digest_input(job: JobRequest) -> str:
    """The canonical JSON text that payload_digest hashes (pure ASCII)."""
    content = {name: getattr(job, name) for name in DIGEST_FIELDS}
    content["messages"] = job.chat_messages()
    content.update(
        {
            name: getattr(job, name)
            for name, default in DEFAULT_ONLY_DIGEST_FIELDS.items()
            if getattr(job, name) != default
        }
    )
    if job.chat_template is not None:  # hashed only when given: older digests stay valid
        content["chat_template"] = job.chat_template
    if job.structured_outputs is not None:
        content["structured_outputs"] = job.structured_outputs_given()
    if job.tools is not None:  # hashed only when given, as structured_outputs
        content.update(job.tools_given())
    if job.lora is not None:
        content["lora"] = job.lora
    if job.cache_salt is not None:
        content["cache_salt"] = job.cache_salt
    return canonical_json(content)


def canonical_json(value: Any) -> str:
    """JSON with sorted keys, no whitespace, every non-ASCII character \\u-escaped and
    numbers written as JavaScript's String(number) writes them (1.0 -> 1, 1e-05 -> 0.00001)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _js_number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical_json(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{canonical_json(k)}:{canonical_json(value[k])}" for k in sorted(value)) + "}"
    raise TypeError(f"no canonical JSON for {type(value).__name__}")


def _js_number(value: float) -> str:
    """ECMAScript Number::toString of a finite float (the shortest round-trip digits,
    which Python's repr also finds, laid out by the ECMAScript rules)."""
    if not math.isfinite(value):
        raise ValueError(f"no JSON number for {value}")
    if value == 0:
        return "0"  # -0 too
    sign, digits, exponent = decimal.Decimal(repr(value)).as_tuple()
    s = "".join(map(str, digits)).rstrip("0")
    k = len(s)
    n = exponent + len(digits)  # value = 0.s x 10^n
    text = (
        s + "0" * (n - k)
        if k <= n <= 21
        else s[:n] + "." + s[n:]
        if 0 < n <= 21
        else "0." + "0" * -n + s
        if -6 < n <= 0
        else s[0] + ("." + s[1:] if k > 1 else "") + "e" + ("+" if n > 0 else "-") + str(abs(n - 1))
    )
    return ("-" if sign else "") + text
