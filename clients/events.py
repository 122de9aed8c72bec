"""Events written to `<ns>:out:<job_id>` and their stream-entry codec.

Each entry has two fields: `type` (b"token" | b"done" | b"error" | b"cancelled") and
`data`, the msgpack of the event dict (which repeats `type`, so `data` alone, as stored in
the job hash's `result`, is self-describing).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.clients.errors import ProtocolError

TERMINAL_TYPES = ("done", "error", "cancelled")
FinishReason = Literal["stop", "length", "abort"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")

    attempt: int = Field(ge=1)
    # Set by the reading client, never sent: the stream entry id, to resume from.
    entry_id: str | None = Field(default=None, exclude=True)

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_TYPES


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    seq: int = Field(ge=0)
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: Any = None
    index: int = Field(default=0, ge=0)  # which of the job's n outputs this delta extends
    # On the first event of a resumed attempt (it continues the output earlier attempts
    # published): keep that output's first `resumed_tokens` token ids (and their logprobs)
    # and first `resumed_chars` characters, drop the rest, then append this delta.
    resumed_tokens: int | None = Field(default=None, ge=0)
    resumed_chars: int | None = Field(default=None, ge=0)
    # Set by the reading client: True on the first token of a rerun (attempt > 1, not
    # resumed); discard the deltas of earlier attempts when you see it.
    reset: bool = Field(default=False, exclude=True)

    def carried_over(self, text: str, token_ids: list, logprobs: list | None = None):
        """What a reader keeps of the output it holds when this event arrives: all of it,
        none (a rerun), or the part a resumed attempt continues. (text, token_ids, logprobs)."""
        logprobs = [] if logprobs is None else logprobs
        if self.reset:
            return "", [], []
        if self.resumed_tokens is None:
            return text, token_ids, logprobs
        return text[: self.resumed_chars or 0], token_ids[: self.resumed_tokens], logprobs[: self.resumed_tokens]


class Usage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those read from the prefix cache (not computed)


class Timings(BaseModel):
    """Seconds: queue wait, time to first token, time per output token, end to end."""

    model_config = ConfigDict(extra="ignore")

    queue: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None


class ToolCall(BaseModel):
    """A call the model made (a job with `tools`): `arguments` is JSON text, as OpenAI's."""

    model_config = ConfigDict(extra="ignore")

    id: str
    name: str
    arguments: str


class ToolOutput(BaseModel):
    """What a replica read from one output of a job with `tools` (fields of the done event
    and of OutputChoice, absent for other jobs): the calls and the text around them, or why
    the text that looked like a call could not be read (then `content` is the whole text)."""

    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    tool_call_error: str | None = None


class OutputChoice(ToolOutput):
    """One output of a job with n > 1 (DoneEvent.outputs[index])."""

    model_config = ConfigDict(extra="ignore")

    index: int = Field(ge=0)
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason


class DoneEvent(ToolOutput, _Event):
    type: Literal["done"] = "done"
    seq: int = Field(default=0, ge=0)  # number of token events of this attempt
    finish_reason: FinishReason  # of output 0
    text: str = ""  # of output 0
    token_ids: list[int] = Field(default_factory=list)  # of output 0
    usage: Usage = Field(default_factory=Usage)  # completion_tokens: all outputs together
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    outputs: list[OutputChoice] | None = None  # n > 1: every output, in index order
    resumed_tokens: int = 0  # output tokens carried over from earlier attempts (a resumed job)

    def all_outputs(self) -> list[OutputChoice]:
        """Every output in index order; an n = 1 job's one output from the flat fields."""
        return self.outputs or [
            OutputChoice(
                index=0,
                text=self.text,
                token_ids=self.token_ids,
                finish_reason=self.finish_reason,
                tool_calls=self.tool_calls,
                content=self.content,
                tool_call_error=self.tool_call_error,
            )
        ]


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str
    message: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Set on a refusal of an entry that could not be decoded or validated: the id of that
    # request-stream entry. Such a refusal is written only where no record of the job id
    # existed, and a later valid submission of the id replaces it.
    rejected_entry: str | None = None


class CancelledEvent(_Event):
    type: Literal["cancelled"] = "cancelled"
    metadata: dict[str, Any] = Field(default_factory=dict)


Event = Union[TokenEvent, DoneEvent, ErrorEvent, CancelledEvent]
TerminalEvent = Union[DoneEvent, ErrorEvent, CancelledEvent]
EVENT_TYPES: dict[str, type[_Event]] = {
    "token": TokenEvent,
    "done": DoneEvent,
    "error": ErrorEvent,
    "cancelled": CancelledEvent,
}


def encode_event(event: Event) -> dict[str, bytes]:
    """Stream-entry fields of one event: {"type": b"token", "data": msgpack bytes}."""
    return {"type": event.type.encode(), "data": encode_event_data(event)}


# Fields of n > 1 jobs, left out at these values: an n = 1 job's events keep their shape
TOOL_FIELDS_AT = {"tool_calls": None, "content": None, "tool_call_error": None}  # jobs without tools
OMITTED_AT = {"index": 0, "outputs": None, **TOOL_FIELDS_AT}


def encode_event_data(event: Event) -> bytes:
    data = _omitted(event.model_dump(), OMITTED_AT)
    if data.get("outputs"):
        data["outputs"] = [_omitted(output, TOOL_FIELDS_AT) for output in data["outputs"]]
    return msgpack.packb(data, use_bin_type=True)


def _omitted(data: dict, defaults: dict) -> dict:
    return {name: value for name, value in data.items() if name not in defaults or value != defaults[name]}


def decode_event(fields: dict, entry_id: str | bytes | None = None) -> Event:
    """Decode one out-stream entry; raises ProtocolError(code="bad_event")."""
    type_hint = _text(fields.get(b"type", fields.get("type")))
    data = fields.get(b"data", fields.get("data"))
    if data is None:
        raise ProtocolError("event entry has no 'data' field", code="bad_event")
    event = decode_event_data(data, type_hint)
    if entry_id is not None:
        event.entry_id = _text(entry_id)
    return event


def decode_event_data(data: bytes, type_hint: str | None = None) -> Event:
    """Decode event msgpack; `type_hint` is used when the dict itself has no `type`."""
    try:
        payload = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"event data is not valid msgpack: {exc}", code="bad_event") from None
    if not isinstance(payload, dict):
        raise ProtocolError("event data must be a msgpack map", code="bad_event")
    event_type = payload.get("type") or type_hint
    model = EVENT_TYPES.get(event_type) if isinstance(event_type, str) else None
    if model is None:
        raise ProtocolError(f"unknown event type {event_type!r}", code="bad_event")
    try:
        return model.model_validate({**payload, "type": event_type})
    except ValidationError as exc:
        raise ProtocolError(f"invalid {event_type} event: {exc}", code="bad_event") from None


def _text(value: str | bytes | None) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value
