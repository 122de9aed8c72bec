"""The tool-calling fields of a job (OpenAI's shapes): `tools`, `tool_choice`, and the
`tool_calls` an assistant message of the history carries. Bounded and checked here;
what the tools mean to the model (the prompt, the grammar, the parsers) lives elsewhere
(clients/tool_grammar.py, clients/tool_parsers.py, engine/chat_tools.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024  # every tool's JSON together
MAX_TOOL_CALLS = 64  # calls of one assistant message
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_ARGUMENTS_CHARS = 64 * 1024
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"  # OpenAI's rule for function names
TOOL_CALL_ID = r"^[A-Za-z0-9_.:\-]{1,128}$"


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI's: the arguments always follow the schema here when forced

    @field_validator("parameters")
    @classmethod
    def _plain_json(cls, value: dict | None) -> dict | None:
        if value is not None:
            json_size(value, "parameters")
        return value


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: that function must be called."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """One call of an assistant message in the history."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str = Field(pattern=TOOL_CALL_ID)
    type: Literal["function"] = "function"
    function: CalledFunction


CHOICES = ("none", "auto", "required")


def tool_choice_of(value: Any) -> Any:
    """`tool_choice` as given, its named form built (one clear message for every wrong shape)."""
    if value is None or isinstance(value, NamedToolChoice) or value in CHOICES:
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            problem = exc.errors(include_url=False)[0]["msg"]
            raise ValueError(
                f"must be {', '.join(CHOICES)} or {{type: function, function: {{name}}}} ({problem})"
            ) from None
    raise ValueError(f"must be {', '.join(CHOICES)} or {{type: function, function: {{name}}}} (got {value!r:.60})")


def json_size(value: Any, what: str, limit: int = MAX_TOOLS_BYTES) -> int:
    """Bytes of `value` as compact JSON; ValueError when it is not plain JSON or over `limit`."""
    try:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{what} must be plain JSON ({exc})") from None
    if size > limit:
        raise ValueError(f"{what} is {size} bytes as JSON, limit {limit}")
    return size


def check_tools(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> str | None:
    """Why `tools` with `choice` cannot be served (names twice, a named choice of no tool), else None."""
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        return "tools: function names must be unique"
    if tools:
        json_size([tool.model_dump(exclude_none=True) for tool in tools], "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return f"tool_choice: names function {choice.function.name!r}, which is not in tools"
    if choice in ("required",) and not tools:
        return "tool_choice: 'required' needs tools"
    return None


def choice_mode(choice: ToolChoice | None) -> str:
    """ "none", "auto", "required" or "named" (no choice given: "auto", as OpenAI)."""
    if choice is None:
        return "auto"
    return "named" if isinstance(choice, NamedToolChoice) else choice
