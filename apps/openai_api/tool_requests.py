"""Tool calling on /v1/chat/completions, the request's side: `tools`, `tool_choice`,
`parallel_tool_calls` and the history's tool messages -> job fields. The job's own
validation (clients/tool_schema.py) checks them in depth; the replica renders them for the
model's chat template (engine/chat_tools.py)."""

from __future__ import annotations

import json

from conveyor.apps.openai_api.errors import invalid

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MESSAGE_TOOL_FIELDS = ("tool_calls", "tool_call_id")


def tool_fields(body: dict) -> dict:
    """The job's tool fields of a chat body (the job's own validation checks them in depth)."""
    tools, choice, parallel = (body.get(name) for name in TOOL_FIELDS)
    if parallel not in (None, True, False):
        raise invalid("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return {}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def message_tool_fields(where: str, message: dict) -> dict:
    """`tool_calls` of an assistant message, `tool_call_id` of a tool message, as given."""
    extras = {name: message[name] for name in MESSAGE_TOOL_FIELDS if message.get(name) is not None}
    if message.get("role") == "tool" and "tool_call_id" not in extras:
        raise invalid(f"{where}.tool_call_id is required for a tool message", param=f"{where}.tool_call_id")
    return extras


def reads_tools(fields: dict) -> bool:
    return bool(fields.get("tools")) and fields.get("tool_choice") != "none"


COUNT_MARGIN_CHARS = 1024  # the tool prompt's own words around the tools' JSON (engine/chat_tools.py)


def counted_messages(fields: dict) -> list[dict]:
    """Plain role/content messages at least as long as what the replica renders for a chat
    with tools (to count the context its prompt leaves with the light tokenizer)."""
    tools = fields.get("tools")
    messages = fields["messages"]
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    plain = [
        {
            "role": "user" if m["role"] == "tool" else m["role"],
            "content": (m.get("content") or "") + json.dumps(m.get("tool_calls") or ""),
        }
        for m in messages
    ]
    listing = json.dumps(tools or []) + " x" * (COUNT_MARGIN_CHARS // 2)
    return [{"role": "system", "content": listing}, *plain]
