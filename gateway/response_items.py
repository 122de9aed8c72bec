"""The Responses API's shapes <-> the chat job's. Pure functions, no I/O.

A Responses body becomes a chat completions body (then the chat path's own checks make
the job): `input` (text, or message / function_call / function_call_output items) after
the history of `previous_response_id` -> `messages`, `instructions` -> a first system
message (not carried over to the next response, as OpenAI's), function `tools` and
`tool_choice` -> the chat forms, `text.format` -> `response_format`,
`max_output_tokens` -> `max_tokens`. A job's result becomes the response's `output`
items: one assistant `message` with its `output_text`, and one `function_call` per call.
"""

from __future__ import annotations

from typing import Any

from conveyor.apps.openai_api.errors import invalid
from conveyor.clients.event_reader import JobResult
from conveyor.gateway.tools import openai_calls

PASSED_ON = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "metadata",
    "user",
    "service_tier",
    "stream",
    "ignore_eos",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "presence_penalty",
    "frequency_penalty",
)
OWN = (
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "previous_response_id",
    "store",
    "background",
    "truncation",
    "reasoning",
    "include",
    "prompt_cache_key",
    "safety_identifier",
)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_INPUT_ITEMS = 4096


def check_fields(body: dict) -> None:
    for name, value in body.items():
        if name not in PASSED_ON and name not in OWN:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name, code="unrecognized_argument")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("truncation: only 'disabled' is supported", param="truncation", code="unsupported_value")
    if body.get("reasoning") not in (None, {}):
        raise invalid("reasoning is not supported by this server", param="reasoning", code="unsupported_value")
    for name in ("store", "background"):
        if body.get(name) not in (None, True, False):
            raise invalid(f"{name} must be a boolean", param=name)


def chat_body(body: dict, conversation: list[dict]) -> dict:
    """The /v1/chat/completions body of a Responses body whose `conversation` (the previous
    response's history and this input, as chat messages) is known."""
    chat = {name: body[name] for name in PASSED_ON if body.get(name) is not None}
    chat["messages"] = instructions(body) + conversation
    chat.update(_tools(body))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    return {**chat, **({"response_format": response_format} if response_format else {})}


def instructions(body: dict) -> list[dict]:
    text = body.get("instructions")
    if text is None:
        return []
    if not isinstance(text, str):
        raise invalid("instructions must be a string", param="instructions")
    return [{"role": "system", "content": text}]


def input_messages(items: Any) -> list[dict]:
    """Chat messages of `input`: a string is one user message; items in order, consecutive
    function_call items become one assistant message with tool_calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or len(items) > MAX_INPUT_ITEMS:
        raise invalid(f"input must be a string or a list of 1 to {MAX_INPUT_ITEMS} items", param="input")
    messages: list[dict] = []
    for index, item in enumerate(items):
        _add_item(messages, f"input[{index}]", item)
    return messages


def _add_item(messages: list[dict], where: str, item: Any) -> None:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        messages.append(_message(where, item))
    elif kind == "function_call":
        call = {
            "id": _text(item, "call_id", where),
            "type": "function",
            "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)},
        }
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
            messages[-1]["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append(
            {"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": _text(item, "output", where)}
        )
    else:
        raise invalid(
            f"{where}.type must be message, function_call or function_call_output, got {kind!r}",
            param=f"{where}.type",
            code="unsupported_value",
        )


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise invalid(f"{where}.role must be one of {MESSAGE_ROLES}, got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(f"{where}.content[{n}]", part) for n, part in enumerate(content))
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    return {"role": role, "content": content}


def _part_text(where: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else None
        raise invalid(f"{where}: only text parts are supported, got {kind!r}", param=where, code="unsupported_value")
    return part["text"]


def _text(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _tools(body: dict) -> dict:
    """Responses' flat function tools ({type, name, parameters...}) and tool_choice -> chat's."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be a list", param="tools")
        chat["tools"] = [_chat_tool(f"tools[{n}]", tool) for n, tool in enumerate(tools)]
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice must be none, auto, required or {type: function, name}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {**chat, **({"tool_choice": choice} if choice is not None else {})}


def _chat_tool(where: str, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(
            f"{where}.type: only function tools are supported, got {kind!r}",
            param=f"{where}.type",
            code="unsupported_value",
        )
    function = {name: tool[name] for name in ("name", "description", "parameters", "strict") if name in tool}
    return {"type": "function", "function": function}


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type must be text, json_object or json_schema", param="text.format.type")
    if form["type"] != "json_schema":
        return {"type": form["type"]}
    return {"type": "json_schema", "json_schema": {"name": form.get("name", "output"), "schema": form.get("schema")}}


# ---------------------------------------------------------------- results -> output items


def output_items(result: JobResult, response_id: str) -> list[dict]:
    """The `output` of a finished response: its message (when it has content), then its calls."""
    output = result.outputs[0]
    calls = openai_calls(output)
    content = (
        output.content if output.content is not None or output.tool_calls or output.tool_call_error else output.text
    )
    items = [message_item(response_id, content)] if content or not calls else []
    return items + [function_call_item(response_id, n, call) for n, call in enumerate(calls)]


def message_item(response_id: str, text: str | None, status: str = "completed") -> dict:
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "type": "message",
        "id": "msg_" + response_id.removeprefix("resp_"),
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def function_call_item(response_id: str, number: int, call: dict, arguments: str | None = None) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{response_id.removeprefix('resp_')}_{number}",
        "call_id": call["id"],
        "name": function["name"],
        "status": "completed",
        "arguments": function["arguments"] if arguments is None else arguments,
    }


def history_of(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat history a next response continues: this one's messages (its instructions
    left out) and its output as an assistant message."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    reply = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    return messages + [reply]


def usage(result: JobResult | None) -> dict | None:
    if result is None:
        return None
    used = result.usage
    return {
        "input_tokens": used.prompt_tokens,
        "output_tokens": used.completion_tokens,
        "total_tokens": used.total_tokens,
        "input_tokens_details": {"cached_tokens": used.cached_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
