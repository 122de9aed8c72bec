"""Tool calling on /v1/chat/completions, the answer's side: the job's calls (the replica
reads them: clients/tool_parsers.py) -> the assistant message's `tool_calls`, in a body
or as stream deltas (the request's side: tool_requests.py).

Finish reasons: `tool_calls` when the output is calls (also for a named tool_choice, where
OpenAI says `stop`), `invalid_tool_call` when the model wrote something that looks like a
call and is not one (the text is then the content, as vLLM returns it), `length` when a
forced call was cut by max_tokens.

Streaming: with a named function each text delta is a piece of the call's arguments, sent
as it comes. With `auto` or `required` the gateway cannot tell calls from content before
the output ends, so it holds the output back and sends it at the end: the content, then
per call one delta with its id and name and then its arguments in pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.apps.openai_api.translate import chat_chunk, finish_reason, usage_chunk
from conveyor.clients.events import DoneEvent, OutputChoice
from conveyor.clients.tool_parsers import call_id
from conveyor.gateway.streaming import ChunkWriter, Relay

ARGUMENT_PIECE_CHARS = 32


def named_function(fields: dict) -> str | None:
    choice = fields.get("tool_choice")
    return choice["function"]["name"] if isinstance(choice, dict) else None


def openai_calls(output: OutputChoice) -> list[dict]:
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in output.tool_calls or []
    ]


def tool_finish(output: OutputChoice) -> str | None:
    if output.tool_calls:
        return "tool_calls"
    if output.tool_call_error and output.finish_reason != "length":
        return "invalid_tool_call"
    return finish_reason(output.finish_reason)


def with_tool_calls(body: dict, outputs: list[OutputChoice]) -> dict:
    """A chat.completion body with each choice's message and finish reason as the calls say."""
    by_index = {output.index: output for output in outputs}
    for choice in body["choices"]:
        output = by_index[choice["index"]]
        calls = openai_calls(output)
        content = (
            output.content if output.content is not None or output.tool_calls or output.tool_call_error else output.text
        )
        choice["message"] = {
            "role": "assistant",
            "content": content or (None if calls else ""),
            **({"tool_calls": calls} if calls else {}),
        }
        choice["finish_reason"] = tool_finish(output)
    return body


@dataclass
class ToolChunkWriter(ChunkWriter):
    """Chunks of a chat stream whose outputs may be tool calls (module docstring)."""

    job_id: str = ""
    named: str | None = None  # tool_choice names this function: the text is its arguments
    opened: set[int] = field(default_factory=set)  # choices whose named call was announced

    def delta(self, text: str, logprobs: list[dict], finish: str | None = None, index: int = 0) -> dict | None:
        if self.named is None or not text:
            return None  # held back: the done event says what it was
        return chat_chunk(self.base, {"tool_calls": [self._named_piece(index, text)]}, index=index)

    def closing(self, done: DoneEvent, relays: dict[int, Relay]) -> list[dict]:
        chunks = []
        for output in done.all_outputs():
            if self.named is not None:
                rest, _ = relays.setdefault(output.index, Relay()).finish(output.text, output.token_ids)
                pieces = [{"tool_calls": [self._named_piece(output.index, rest)]}] if rest else []
            else:
                pieces = _held_back(output)
            chunks += [chat_chunk(self.base, piece, index=output.index) for piece in pieces]
            chunks.append(chat_chunk(self.base, {}, finish=tool_finish(output), index=output.index))
        return chunks + ([usage_chunk(self.base, done.usage)] if self.include_usage else [])

    def _named_piece(self, index: int, text: str) -> dict[str, Any]:
        piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if index not in self.opened:
            self.opened.add(index)
            piece.update(id=call_id(self.job_id, index, 0), type="function")
            piece["function"]["name"] = self.named
        return piece


def _held_back(output: OutputChoice) -> list[dict]:
    """One output's deltas at its end: content, then each call's header and argument pieces."""
    content = (
        output.content if output.content is not None or output.tool_calls or output.tool_call_error else output.text
    )
    deltas = [{"content": content}] if content else []
    for number, call in enumerate(output.tool_calls or []):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": number,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        )
        pieces = [
            call.arguments[at : at + ARGUMENT_PIECE_CHARS] for at in range(0, len(call.arguments), ARGUMENT_PIECE_CHARS)
        ]
        deltas += [{"tool_calls": [{"index": number, "function": {"arguments": piece}}]} for piece in pieces]
    return deltas
