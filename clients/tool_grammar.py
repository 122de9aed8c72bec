"""The structured output that forces a tool call (`tool_choice` required or named), as vLLM
does it: a JSON schema over the tools' own parameter schemas, so even a small model's
arguments validate.

  named      the output is the function's arguments object (its `parameters` schema)
  required   the output is a JSON list of `{"name": ..., "parameters": {...}}`, one item
             per call: exactly one when parallel_tool_calls is false, else at most
             MAX_PARALLEL_CALLS (a small model that repeats one call stops there, and the
             reader drops the repeats: clients/tool_parsers.py)

Both without whitespace outside strings: a model unsure of itself cannot spend its
max_tokens on blank lines the grammar would otherwise allow.
"""

from __future__ import annotations

from typing import Any

from conveyor.clients.tool_schema import NamedToolChoice, ToolChoice, ToolSpec, choice_mode

ANY_OBJECT = {"type": "object"}
MAX_PARALLEL_CALLS = 8  # calls one required-choice output may hold


def forced_call_schema(tools: list[ToolSpec], choice: ToolChoice | None, parallel: bool) -> dict | None:
    """The `structured_outputs` of a job whose tool choice forces a call, else None."""
    mode = choice_mode(choice)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        return {"json": _parameters(_tool(tools, choice.function.name)), "disable_any_whitespace": True}
    if mode == "required":
        items = {"anyOf": [_call_schema(tool) for tool in tools]}
        schema = {"type": "array", "items": items, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return {"json": schema, "disable_any_whitespace": True}
    return None


def _tool(tools: list[ToolSpec], name: str) -> ToolSpec:
    return next(tool for tool in tools if tool.function.name == name)


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
