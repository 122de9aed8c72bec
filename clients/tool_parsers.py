"""Reading a model's output as tool calls. Pure functions, no I/O.

Parsers (chosen per model by its chat template, overridable with `--tool-call-parser`):

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
               before them is the content (Qwen2.5, Qwen3, Hermes; and the fallback
               prompt of engine/chat_tools.py for templates that know no tools)
  llama3_json  the whole output is `{"name": ..., "parameters": {...}}` (optionally after
               `<|python_tag|>`), several separated by `;` (Llama 3.1-3.3)

With `tool_choice` required or named the output was generated under a grammar
(clients/tool_grammar.py) and is read by that grammar's shape, whatever the parser. A
required-choice list cut by max_tokens gives its complete calls, and a call repeated word for
word ends the list there (a small model repeats one call until it runs out of tokens).

With `tool_choice` auto the content comes back without tool-calling markup a model echoes
from its prompt (`<tool_response>`, `<tools>` and their closing tags; Qwen's template and the
fallback prompt show them), and without a dangling `<tool_call>`: an empty one, or an
unclosed one followed by prose. The content is then given even when there is no call, for
the reply to use instead of the raw text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from conveyor.clients.events import ToolCall, ToolOutput

PARSERS = ("hermes", "llama3_json")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)
ECHOED_MARKUP = re.compile(r"</?(?:tool_response|tools)>")  # never part of an answer
CALL_TAGS = re.compile(r"</?tool_call>")
PYTHON_TAG = "<|python_tag|>"


class Unreadable(ValueError):
    """Text that looks like a tool call and is not one."""


@dataclass(frozen=True)
class ToolReading:
    """How a job's outputs are read: `mode` is auto, required or named (tool_choice),
    `names` the functions the job offered."""

    mode: str
    parser: str
    names: tuple[str, ...]
    job_id: str

    def read(self, text: str, index: int = 0) -> ToolOutput:
        """The calls in one output; an unreadable call comes back as content with the reason."""
        try:
            calls = self._calls(text)
        except Unreadable as exc:
            return ToolOutput(content=without_markup(text), tool_call_error=str(exc))
        if calls is None:
            content = without_markup(text) if self.mode == "auto" else text
            return ToolOutput() if content == text else ToolOutput(content=content)
        content, found = calls
        if not found:  # only dangling <tool_call> tags: an answer in prose
            return ToolOutput(content=content)
        unknown = [name for name, _ in found if name not in self.names]
        if unknown:
            return ToolOutput(
                content=text, tool_call_error=f"the model called {unknown[0]!r}, which is not a tool of this request"
            )
        return ToolOutput(
            content=content or None,
            tool_calls=[
                ToolCall(id=call_id(self.job_id, index, n), name=name, arguments=arguments)
                for n, (name, arguments) in enumerate(found)
            ],
        )

    def _calls(self, text: str) -> tuple[str, list[tuple[str, str]]] | None:
        if self.mode == "named":
            _json(text)  # a grammar made it: only a truncated output (max_tokens) fails here
            return "", [(self.names[0], text)]
        if self.mode == "required":
            return "", _until_repeated([_named(item) for item in _complete_items(text)])
        return parse(text, self.parser)


def parse(text: str, parser: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of free text, None when it holds no call; Unreadable."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3(text)
    raise ValueError(f"unknown tool call parser {parser!r}; one of {PARSERS}")


def without_markup(text: str, pattern: re.Pattern = ECHOED_MARKUP) -> str:
    """`text` without the tags of `pattern` (as it is when it holds none), blank runs tidied."""
    if not pattern.search(text):
        return text
    tags = rf"(?:[ \t]*(?:{pattern.pattern}))+[ \t]*"
    text = re.sub(rf"(?m)^{tags}(?:\n|$)", "", text)  # tags on a line of their own: the line too
    text = re.sub(rf"(?m)^{tags}|{tags}$", "", text)  # at the start or end of a line
    text = re.sub(tags, " ", text)  # between words
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def call_id(job_id: str, index: int, n: int) -> str:
    """A call's id, the same on every attempt of the job (a rerun reproduces its output)."""
    return "call_" + hashlib.sha256(f"{job_id}/{index}/{n}".encode()).hexdigest()[:24]


def _hermes(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = [
        _named(_json(body))
        for body, closing in HERMES_CALL.findall(text, start)
        if body and (closing or body.startswith("{"))  # else dangling: an empty or unclosed tag before prose
    ]
    if not calls:
        return without_markup(without_markup(text), CALL_TAGS), []
    return without_markup(text[:start]).strip(), calls


def _llama3(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError as exc:
            raise Unreadable(f"the tool call is not JSON: {exc}") from None
        calls.append(_named(value))
        at = _skip_separator(body, end)
    return "", calls


def _skip_separator(body: str, at: int, separators: str = " \t\r\n;") -> int:
    while at < len(body) and body[at] in separators:
        at += 1
    return at


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise Unreadable(f"the tool call is not JSON: {exc}") from None


def _complete_items(text: str) -> list:
    """The complete items of a JSON list, also when the text stops inside it (max_tokens)."""
    body, decoder, items = text.strip(), json.JSONDecoder(), []
    at = 1 if body.startswith("[") else len(body) + 1
    while at < len(body) and body[at] != "]":
        try:
            value, at = decoder.raw_decode(body, _skip_separator(body, at, ", \t\r\n"))
        except ValueError:
            break  # cut inside an item
        items.append(value)
        at = _skip_separator(body, at, " \t\r\n")
        if at < len(body) and body[at] not in ",]":
            raise Unreadable(f"the tool calls are not a JSON list (unexpected {body[at]!r})")
    if not items:
        raise Unreadable("the tool calls are not a non-empty JSON list")
    return items


def _until_repeated(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The calls before the first one that repeats an earlier call word for word."""
    seen = set()
    for index, call in enumerate(calls):
        if call in seen:
            return calls[:index]
        seen.add(call)
    return calls


def _named(call: Any) -> tuple[str, str]:
    """(name, arguments JSON) of one decoded call object."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise Unreadable("a tool call must be a JSON object with a string `name`")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        raise Unreadable(f"the arguments of {call['name']!r} are not a JSON object")
    return call["name"], json.dumps(arguments, ensure_ascii=False)
