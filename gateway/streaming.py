"""Server-sent events of one job: its token events as OpenAI chunks, one continuous stream
even when the job is rerun on another replica, then `data: [DONE]`.

A job with n > 1 streams its outputs interleaved, each token event naming its `index`:
each becomes the chunks of choice `index`, with a Relay of its own.

A rerun (attempt + 1, after a replica crash) starts again from the first token. Every
gateway job has a seed, so the rerun regenerates the same tokens: the Relay checks them
against what the client already got and passes on only what goes beyond it. If they ever
differ, the stream ends with an error event rather than with inconsistent text. An error
after the stream started is sent as vLLM sends it: `data: {"error": {...}}`, then
`data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from redis.exceptions import RedisError

from conveyor.apps.openai_api.errors import OpenAIError, from_conveyor
from conveyor.apps.openai_api.translate import (
    Vocabulary,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    finish_reason,
    usage_chunk,
)
from conveyor.clients.errors import ConveyorError, JobFailed
from conveyor.clients.event_reader import outcome
from conveyor.clients.events import DoneEvent, Event, TokenEvent

DONE_LINE = "data: [DONE]\n\n"
log = logging.getLogger(__name__)


class StreamDiverged(Exception):
    """A rerun produced output that differs from what the client was already sent."""


class BadLogprobs(Exception):
    """A token event whose logprob entries are not those of its own tokens."""


def checked_logprobs(event: TokenEvent) -> list[dict]:
    """The event's logprob entries, one per token id and naming it (else BadLogprobs:
    never pass on numbers that belong to other tokens)."""
    entries = event.logprobs or []
    if entries and [entry.get("token_id") for entry in entries] != event.token_ids:
        raise BadLogprobs(
            f"the replica sent logprobs of tokens {[e.get('token_id') for e in entries]} with tokens {event.token_ids}"
        )
    return entries


def _agree(new: Any, sent: Any) -> bool:
    common = min(len(new), len(sent))
    return new[:common] == sent[:common]


@dataclass
class Relay:
    """What the client was sent (text, token ids) and the current attempt's output."""

    sent_text: str = ""
    sent_ids: list[int] = field(default_factory=list)
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # one per id of the current attempt

    def feed(self, event: TokenEvent) -> tuple[str, list[dict]]:
        """The text and logprob entries of `event` the client has not seen yet."""
        # a rerun starts over, a resumed attempt continues what its readers hold
        self.text, self.ids, self.logprobs = event.carried_over(self.text, self.ids, self.logprobs)
        self.text += event.text
        self.ids += event.token_ids
        self.logprobs += checked_logprobs(event)
        return self._advance()

    def restart(self) -> None:
        """A rerun: the job starts over from the first token (what was sent stays sent)."""
        self.text, self.ids, self.logprobs = "", [], []

    def finish(self, text: str, token_ids: list[int]) -> tuple[str, list[dict]]:
        """What remains of the final attempt's whole output (the done event's)."""
        self.text, self.ids = text, list(token_ids)
        if len(self.text) < len(self.sent_text) or len(self.ids) < len(self.sent_ids):
            raise StreamDiverged("the job's final output is shorter than what was already sent")
        return self._advance()

    def _advance(self) -> tuple[str, list[dict]]:
        if not (_agree(self.text, self.sent_text) and _agree(self.ids, self.sent_ids)):
            raise StreamDiverged("the rerun of the job produced different output than what was already sent")
        new_text = self.text[len(self.sent_text) :]
        new_logprobs = self.logprobs[len(self.sent_ids) : len(self.ids)]
        if len(self.text) > len(self.sent_text):
            self.sent_text = self.text
        if len(self.ids) > len(self.sent_ids):
            self.sent_ids = list(self.ids)
        return new_text, new_logprobs


@dataclass
class ChunkWriter:
    """OpenAI chunks of one request: chat (`chat.completion.chunk`) or completions."""

    chat: bool
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    vocab: Vocabulary | None = None  # set when logprobs were asked for
    n: int = 1  # choices
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions' logprobs, per choice: next token's start

    @property
    def base(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        base = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return {**base, "usage": None} if self.include_usage else base

    def opening(self) -> list[dict]:
        if not self.chat:
            return []
        return [chat_chunk(self.base, {"role": "assistant", "content": ""}, index=i) for i in range(self.n)]

    def delta(self, text: str, logprobs: list[dict], finish: str | None = None, index: int = 0) -> dict | None:
        if not text and not logprobs and finish is None:
            return None
        rendered = self._logprobs(logprobs, index)
        if self.chat:
            return chat_chunk(
                self.base, {"content": text} if text else {}, logprobs=rendered, finish=finish, index=index
            )
        return completion_chunk(self.base, text, logprobs=rendered, finish=finish, index=index)

    def closing(self, done: DoneEvent, relays: dict[int, "Relay"]) -> list[dict]:
        """Each choice's last chunk (what remains of its output, its finish reason), then usage."""
        chunks = [
            self.delta(
                *relays.setdefault(output.index, Relay()).finish(output.text, output.token_ids),
                finish_reason(output.finish_reason),
                index=output.index,
            )
            for output in done.all_outputs()
        ]
        return chunks + ([usage_chunk(self.base, done.usage)] if self.include_usage else [])

    def _logprobs(self, entries: list[dict], index: int) -> Any:
        if self.vocab is None or not entries:
            return None
        if self.chat:
            return chat_logprobs(entries, self.vocab)
        rendered = completion_logprobs(entries, self.vocab, self.text_offsets.get(index, 0))
        self.text_offsets[index] = self.text_offsets.get(index, 0) + sum(len(token) for token in rendered["tokens"])
        return rendered


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_events(
    first: Event,
    events: AsyncIterator[Event],
    writer: ChunkWriter,
    finished: Callable[[], Awaitable[None]],
    abandon: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """The response body: chunks of `first` and then of the rest of `events`.

    `finished` runs when the job reached its end; `abandon` when the stream stops before
    that (the client went away, the deadline passed, the rerun diverged)."""
    relays: dict[int, Relay] = {}  # by choice index
    ended = False
    try:
        for chunk in writer.opening():
            yield sse(chunk)
        async for event in _chain(first, events):
            if isinstance(event, TokenEvent):
                if event.reset:  # a rerun restarts every output, whichever event shows it first
                    for relay in relays.values():
                        relay.restart()
                chunk = writer.delta(*relays.setdefault(event.index, Relay()).feed(event), index=event.index)
                if chunk is not None:
                    yield sse(chunk)
                continue
            ended = True
            for line in _terminal_lines(event, writer, relays):
                yield line
            break
    except (ConveyorError, StreamDiverged, BadLogprobs, RedisError) as exc:  # Timeout: the deadline passed
        yield sse(_stream_error(exc).body())
        yield DONE_LINE
    finally:
        await (finished() if ended else abandon())


def _terminal_lines(event: Event, writer: ChunkWriter, relays: dict[int, Relay]) -> list[str]:
    try:
        outcome("", event)  # raises JobFailed for error and cancelled events
        chunks = writer.closing(event, relays)
        return [sse(chunk) for chunk in chunks if chunk is not None] + [DONE_LINE]
    except (JobFailed, StreamDiverged) as exc:
        return [sse(_stream_error(exc).body()), DONE_LINE]


def _stream_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, (StreamDiverged, BadLogprobs)):
        return stream_fault(exc)
    if isinstance(exc, RedisError):
        return OpenAIError(503, "the queue (Redis) became unavailable", code="queue_unavailable")
    return from_conveyor(exc)


def stream_fault(exc: StreamDiverged | BadLogprobs) -> OpenAIError:
    log.error("ending a request: %s", exc)
    code = "stream_diverged" if isinstance(exc, StreamDiverged) else "bad_logprobs"
    return OpenAIError(500, str(exc), code=code)


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in rest:
        yield event
