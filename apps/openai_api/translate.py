"""OpenAI request bodies -> job fields (keyword arguments of AsyncClient.submit), and job
results -> OpenAI response objects and stream chunks. Pure functions: no I/O.

A field is accepted only if the job honours it or it cannot change the output (`user`,
`metadata`, `store`, ...); one that would change the output and is not supported
(`best_of > 1`, `functions`, `logit_bias`, `echo`...) is a 400 naming it, and so is an unknown
field (as OpenAI does: a new SDK option is never silently dropped). `n` is the job's `n`:
its outputs are `choices[i]`.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Iterable, Protocol

from conveyor.apps.openai_api.errors import from_conveyor, invalid
from conveyor.apps.openai_api.tool_requests import TOOL_FIELDS, message_tool_fields, tool_fields
from conveyor.clients.errors import InvalidJob
from conveyor.clients.event_reader import JobResult
from conveyor.clients.events import Usage
from conveyor.clients.submission import build_job

BATCH_TIERS = ("flex",)
INTERACTIVE_TIERS = ("auto", "default", "priority", "scale", "fast")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
UNLIKELY_LOGPROB = -9999.0  # OpenAI's stand-in for a logprob that is not a finite number


# ---------------------------------------------------------------- field rules


def _absent(value: Any) -> bool:
    return value is None or value in ("", [], {})


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


def _false(value: Any) -> bool:
    return value is None or value is False


def _no_tool(value: Any) -> bool:
    return value in (None, "none", "auto")


# name -> "this value changes nothing"; any other value is unsupported (400)
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _one,
    "echo": _false,
    "suffix": _absent,
    "logit_bias": _absent,
}
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _absent,
    "functions": _absent,
    "function_call": _no_tool,
    "audio": _absent,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _absent,
    "web_search_options": _absent,
    "reasoning_effort": _absent,
    "verbosity": _absent,
    "moderation": _absent,
}
# accepted and not passed on: they do not change what is generated
NEUTRAL = (
    "user",
    "metadata",
    "store",
    "stream",
    "stream_options",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)
# OpenAI's sampling fields and vLLM's extras (cache_salt too): same names and meaning as the job's
SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "n",
    "cache_salt",
)
# the output's shape: OpenAI's response_format (json_object, json_schema), or vLLM's structured_outputs
STRUCTURED = ("response_format", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "logprobs",
    *SAMPLING,
    *STRUCTURED,
    *NEUTRAL,
    *COMPLETION_UNSUPPORTED,
}
CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    *SAMPLING,
    *STRUCTURED,
    *NEUTRAL,
    *CHAT_UNSUPPORTED,
    *TOOL_FIELDS,
}


def _check_fields(body: Any, known: set[str], unsupported: dict[str, Callable[[Any], bool]]) -> None:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_request")
    for name, value in body.items():
        if name not in known:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name, code="unrecognized_argument")
        if name in unsupported and not unsupported[name](value):
            raise invalid(
                f"{name}={_short(value)} is not supported by this server", param=name, code="unsupported_value"
            )


# ---------------------------------------------------------------- requests -> jobs


def job_from_completion(body: dict) -> dict:
    """Keyword arguments of AsyncClient.submit for a /v1/completions body; OpenAIError(400)."""
    _check_fields(body, COMPLETION_FIELDS, COMPLETION_UNSUPPORTED)
    stream_flags(body)
    fields = {
        **_common(body),
        **_prompt(body.get("prompt")),
        "max_tokens": body.get("max_tokens"),
        "logprobs": body.get("logprobs"),
    }
    return _validated(fields, {"prompt_token_ids": "prompt", **_structured_params(body)})


def job_from_chat(body: dict) -> dict:
    """Keyword arguments of AsyncClient.submit for a /v1/chat/completions body; OpenAIError(400).

    `max_tokens` is left out when the body gives none: the caller fills in the context the
    prompt leaves (it needs the model's tokenizer), as OpenAI and vLLM do."""
    _check_fields(body, CHAT_FIELDS, CHAT_UNSUPPORTED)
    stream_flags(body)
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    fields = {
        **_common(body),
        "messages": _messages(body.get("messages")),
        "max_tokens": body.get(limit_name),
        "logprobs": _chat_logprobs(body),
        **tool_fields(body),
    }
    top = "top_logprobs" if body.get("top_logprobs") is not None else "logprobs"
    return _validated(fields, {"max_tokens": limit_name, "logprobs": top, **_structured_params(body)})


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a body, checked."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream not in (None, True, False):
        raise invalid("stream must be a boolean", param="stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise invalid("stream_options must be an object with a boolean include_usage", param="stream_options")
    return True, bool(options.get("include_usage"))


def priority_of_tier(tier: Any) -> str | None:
    """`service_tier` -> the job's priority class: flex is batch work, the others interactive."""
    if tier is None:
        return None
    if tier in BATCH_TIERS:
        return "batch"
    if tier in INTERACTIVE_TIERS:
        return "interactive"
    raise invalid(
        f"service_tier must be one of {(*INTERACTIVE_TIERS, *BATCH_TIERS)}, got {_short(tier)}", param="service_tier"
    )


def _common(body: dict) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", param="model", code="missing_model")
    fields = {name: body.get(name) for name in SAMPLING}
    if fields["seed"] is None:  # a rerun after a replica crash must reproduce the same tokens
        fields["seed"] = secrets.randbits(63)
    return {
        "model": model,
        **fields,
        "priority_class": priority_of_tier(body.get("service_tier")),
        "metadata": _metadata(body),
        "structured_outputs": _structured_outputs(body),
    }


def _structured_outputs(body: dict) -> dict | None:
    """The job's structured_outputs: vLLM's field as given (the job checks it), or OpenAI's
    response_format: json_object -> any JSON object, json_schema -> its `schema`."""
    response_format, given = body.get("response_format"), body.get("structured_outputs")
    if given is not None:
        if response_format not in (None, {"type": "text"}):
            raise invalid("give response_format or structured_outputs, not both", param="structured_outputs")
        return given
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise invalid(
            f"response_format.type must be one of {RESPONSE_FORMATS}, got {_short(kind)}",
            param="response_format.type",
            code="unsupported_value",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise invalid(
            "response_format.json_schema.schema must be a JSON Schema object",
            param="response_format.json_schema.schema",
        )
    return {"json": spec["schema"]}


def _structured_params(body: dict) -> dict[str, str]:
    """Job field -> the request field it came from, for error messages."""
    if body.get("structured_outputs") is not None or body.get("response_format") is None:
        return {}
    return {"structured_outputs": "response_format", "structured_outputs.json": "response_format.json_schema.schema"}


def _metadata(body: dict) -> dict:
    """`user` and `metadata` travel with the job (echoed in its terminal event)."""
    return {name: body[name] for name in ("user", "metadata") if body.get(name) is not None}


def _prompt(prompt: Any) -> dict:
    """A string, a one-item list of strings, token ids, or a one-item list of token-id lists."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt must be a string, a list of token ids, or a one-item list of either", param="prompt")
    if all(_is_int(item) for item in prompt):
        return {"prompt_token_ids": prompt}
    if len(prompt) > 1 and all(isinstance(item, (str, list)) for item in prompt):
        raise invalid(
            f"a request holds one prompt, got {len(prompt)}: send one request per prompt",
            param="prompt",
            code="unsupported_value",
        )
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return {"prompt": prompt[0]}
    if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] and all(map(_is_int, prompt[0])):
        return {"prompt_token_ids": prompt[0]}
    raise invalid("prompt must be a string, a list of token ids, or a one-item list of either", param="prompt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    return [_message(index, message) for index, message in enumerate(messages)]


def _message(index: int, message: Any) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        hint = " (use tool messages: function messages are not supported)" if role == "function" else ""
        raise invalid(f"{where}.role must be one of {CHAT_ROLES}, got {_short(role)}{hint}", param=f"{where}.role")
    for name, value in message.items():
        if name not in MESSAGE_FIELDS and not _absent(value):
            raise invalid(
                f"{where}.{name} is not supported by this server", param=f"{where}.{name}", code="unsupported_value"
            )
    extras = message_tool_fields(where, message)
    content = (
        None
        if extras.get("tool_calls") and not message.get("content")
        else _content(where, message.get("content"), role)
    )
    return {"role": role, **({} if content is None else {"content": content}), **extras}


def _content(where: str, content: Any, role: str) -> str:
    """Text content: a string, or text parts joined by newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise invalid(
                f"{where}.content[{number}]: only text parts are supported, got {_short(kind)}",
                param=f"{where}.content[{number}]",
                code="unsupported_value",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_logprobs(body: dict) -> int | None:
    """`logprobs: true` (+ `top_logprobs: N`) -> the job's logprobs (N alternatives)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise invalid("logprobs must be a boolean", param="logprobs")
    if top is not None and not wanted:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    return top if top is not None else (0 if wanted else None)


def _validated(fields: dict, params: dict[str, str]) -> dict:
    """The fields without the unset ones, checked as the queue will check them."""
    fields = {name: value for name, value in fields.items() if value is not None}
    try:
        build_job(fields)
    except InvalidJob as exc:
        raise from_conveyor(exc, params) from None
    return fields


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------- results -> responses


class Vocabulary(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_body(
    result: JobResult, *, request_id: str, model: str, created: int, logprobs: dict[int, dict] | None = None
) -> dict:
    """A `text_completion` object, one choice per job output; `logprobs`: by choice index,
    as completion_logprobs renders them."""
    choices = [
        {
            "index": output.index,
            "text": output.text,
            "logprobs": (logprobs or {}).get(output.index),
            "finish_reason": finish_reason(output.finish_reason),
        }
        for output in result.outputs
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(result.usage),
    }


def chat_body(
    result: JobResult,
    *,
    request_id: str,
    model: str,
    created: int,
    logprobs: dict[int, list] | None = None,
    service_tier: str | None = None,
) -> dict:
    """A `chat.completion` object, one choice per job output; `logprobs`: by choice index,
    the `content` list chat_logprobs renders."""
    rendered = logprobs or {}
    choices = [
        {
            "index": output.index,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": {"content": rendered[output.index]} if output.index in rendered else None,
            "finish_reason": finish_reason(output.finish_reason),
        }
        for output in result.outputs
    ]
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(result.usage),
    }
    if service_tier:
        body["service_tier"] = service_tier
    return body


def completion_chunk(
    base: dict, text: str, *, logprobs: dict | None = None, finish: str | None = None, index: int = 0
) -> dict:
    """`base`: id, object ("text_completion"), created, model (+ usage None with include_usage)."""
    return {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(
    base: dict, delta: dict, *, logprobs: list | None = None, finish: str | None = None, index: int = 0
) -> dict:
    """`base`: id, object ("chat.completion.chunk"), created, model (+ usage None)."""
    rendered = None if logprobs is None else {"content": logprobs}
    return {**base, "choices": [{"index": index, "delta": delta, "logprobs": rendered, "finish_reason": finish}]}


def usage_chunk(base: dict, usage: Usage) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the whole usage."""
    return {**base, "choices": [], "usage": usage_body(usage)}


# ---------------------------------------------------------------- logprobs


def completion_logprobs(entries: Iterable[dict], vocab: Vocabulary, text_offset: int = 0) -> dict:
    """OpenAI's legacy logprobs object for token events' `logprobs` entries
    ({token_id, logprob, top: [[id, logprob], ...]}); offsets count from `text_offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = vocab.decode([entry["token_id"]])
        out["tokens"].append(token)
        out["token_logprobs"].append(_finite(entry["logprob"]))
        out["top_logprobs"].append({vocab.decode([t]): _finite(lp) for t, lp in entry.get("top") or []})
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(entries: Iterable[dict], vocab: Vocabulary) -> list[dict]:
    """The `logprobs.content` list of a chat choice."""
    return [
        {
            **_token_logprob(vocab, entry["token_id"], entry["logprob"]),
            "top_logprobs": [_token_logprob(vocab, t, lp) for t, lp in entry.get("top") or []],
        }
        for entry in entries
    ]


def _token_logprob(vocab: Vocabulary, token_id: int, logprob: float) -> dict:
    token = vocab.decode([token_id])
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY_LOGPROB  # -inf is not JSON
