"""PublisherActor: writes every job's events of a step in one pipelined round trip; a
finished job's terminal event and status are stored before its request entry is acked."""

import logging
import time

from redis.exceptions import ResponseError

from conveyor.actors.base import Actor
from conveyor.actors.messages import Delivery, EntryDone, EntryRefused, JobEnded, Release, StepOutputs
from conveyor.actors.streams import Streams
from conveyor.clients.events import (
    CancelledEvent,
    DoneEvent,
    ErrorEvent,
    OutputChoice,
    Timings,
    TokenEvent,
    Usage,
    encode_event,
)
from conveyor.clients.log_limits import RateLimitedLog, shown
from conveyor.clients.webhook_queue import queue_event
from conveyor.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)
WEBHOOK_EVENTS = {"done": "job.completed", "error": "job.failed"}  # a cancelled job: none (as OpenAI's jobs)
ABORT_MESSAGES = {"deadline_exceeded": "the job's deadline passed while it was running"}


class PublisherActor(Actor):
    name = "publisher"
    mailbox_size = 4096  # steps keep their outputs here while Redis is briefly away

    def __init__(self, streams: Streams, ledger: Actor, metrics=None):
        """``metrics``: a ReplicaMetrics, told each done job's usage by namespace and model."""
        super().__init__()
        self.streams = streams
        self.ledger = ledger
        self.metrics = metrics
        self.next_seq: dict[str, int] = {}  # job id -> seq of its next token event
        self.tracer = None  # a JobTracer where OTEL_* asks for traces (actors/tracing.py)
        self.warnings = RateLimitedLog(log)

    async def run(self) -> None:
        while not self.stopped:
            message = await self.mailbox.get()
            if isinstance(message, StepOutputs):
                await self._publish_step(message)
            elif isinstance(message, EntryRefused):
                await self._publish_refused(message)
            else:
                await self._publish_ended(message)
            self.mailbox.task_done()

    async def _publish_step(self, message: StepOutputs) -> None:
        # events are built once: a retried round trip resends the very same events
        tokens, finishes, ended = [], [], {}
        for delivery, output, abort_reason in message.items:
            for completion in output.outputs:  # n > 1: one token event per output that advanced
                if completion.new_token_ids or completion.new_text:
                    tokens.append((delivery, encode_event(self._token(delivery, completion))))
            if output.finished:
                status, event = self._terminal(delivery, output, abort_reason)
                # what the engine served is billed, done or not (a cancel after the last token, too)
                finishes.append((delivery, status, encode_event(event), usage_of(output)))
                ended[delivery.job_id] = (output, getattr(event, "message", None))

        finish_at: list[int] = []  # pipeline index of each finish

        async def queue(pipe):
            finish_at.clear()
            for delivery, event in tokens:
                self.streams.queue_token_event(pipe, delivery, event)
            for delivery, status, event, usage in finishes:
                finish_at.append(len(pipe))  # commands queued so far
                await self.streams.queue_finish(pipe, delivery, status, event, usage)

        published_from = time.time()
        replies = await self.streams.write(queue, "publish step")
        published = (published_from, time.time())
        if self.metrics is not None:  # what FINISH_LUA stored (1), as the usage counters bill it
            for (*_, usage), index in zip(finishes, finish_at):
                if replies[index] == 1:
                    self.metrics.record_usage(self.streams.keys.ns, self.streams.model_name, usage)
        stored = [
            (delivery, status) for (delivery, status, *_), index in zip(finishes, finish_at) if replies[index] == 1
        ]
        await self._queue_webhooks(stored)
        unstored = [
            (delivery, replies[index])
            for (delivery, *_), index in zip(finishes, finish_at)
            if isinstance(replies[index], ResponseError)
        ]
        parked = {delivery.job_id: f"result could not be stored: {error}" for delivery, error in unstored}
        for delivery, status, _, usage in finishes:
            output, error = ended[delivery.job_id]
            dead_letter = parked.get(delivery.job_id)
            self._end_spans(delivery, status, output, usage, error, dead_letter=dead_letter, published=published)
        if len(unstored) < sum(isinstance(reply, ResponseError) for reply in replies):
            self.warnings.warning(
                "token-events",
                "some token events could not be written: %s",
                shown(str(next(r for r in replies if isinstance(r, ResponseError))), 200),
            )
        await self._park_unstored(unstored)
        await self._release([delivery for delivery, *_ in finishes])

    async def _park_unstored(self, unstored: list[tuple[Delivery, ResponseError]]) -> None:
        """A result that could not be stored (its job's keys were clobbered by a producer):
        the entry is dead-lettered with the reason instead of running again and again."""
        if not unstored:
            return
        self.warnings.warning(
            "result",
            "could not store the result of %d job(s), e.g. %s: %s",
            len(unstored),
            unstored[0][0].job_id,
            shown(str(unstored[0][1]), 200),
        )

        async def queue(pipe):
            for delivery, error in unstored:
                self.streams.queue_dead_letter(
                    pipe,
                    delivery.stream,
                    delivery.entry_id,
                    f"result could not be stored: {error}"[:4096],
                    None,
                    job_id=delivery.job_id,
                    size=delivery.size,
                )

        await self.streams.write(queue, "park unstored results")

    async def _publish_ended(self, message: JobEnded) -> None:
        delivery = message.delivery
        event = encode_event(self._ended_event(message))
        finish_at: list[int] = []

        async def queue(pipe):
            if message.dead_letter_reason is not None:
                self.streams.queue_dead_letter(
                    pipe,
                    delivery.stream,
                    delivery.entry_id,
                    message.dead_letter_reason,
                    message.raw_fields,
                    keep_payload=message.raw_fields is not None,
                    job_id=delivery.job_id,
                    size=delivery.size,
                )
            finish_at[:] = [len(pipe)]
            await self.streams.queue_finish(pipe, delivery, message.event_type, event)

        replies = await self.streams.write(queue, "publish ended job")
        if isinstance(replies[finish_at[0]], ResponseError):
            await self._park_unstored([(delivery, replies[finish_at[0]])])
        elif replies[finish_at[0]] == 1:
            await self._queue_webhooks([(delivery, message.event_type)])
        self._end_spans(delivery, message.event_type, error=message.message, dead_letter=message.dead_letter_reason)
        await self._release([delivery])

    async def _queue_webhooks(self, stored: list[tuple[Delivery, str]]) -> None:
        """job.completed / job.failed for the stored outcomes of jobs that asked (gateway/webhooks.py sends them)."""
        wanted = [(d, WEBHOOK_EVENTS[status]) for d, status in stored if d.webhook and status in WEBHOOK_EVENTS]
        if not wanted:
            return

        async def queue(pipe):
            for delivery, event_type in wanted:
                queue_event(pipe, self.streams.keys.webhooks, event_type, delivery.job_id)

        replies = await self.streams.write(queue, "queue webhook events")
        for reply in replies:
            if isinstance(reply, ResponseError):
                self.warnings.warning("webhooks", "cannot queue webhook events: %s", shown(str(reply), 200))

    def _end_spans(self, delivery: Delivery, status: str, output=None, usage=None, error=None, **more) -> None:
        if self.tracer is None or delivery.spans is None:
            return
        try:
            if delivery.resumed:
                delivery.spans.attempt.set_attribute("conveyor.resumed_tokens", delivery.resumed[0])
            self.tracer.end(delivery.spans, status, output, usage, error, **more)
        except Exception as exc:  # noqa: BLE001 - tracing never stops publishing, nor the replica
            self.warnings.warning(
                "tracing", "cannot end the spans of job %s: %s", delivery.job_id, shown(repr(exc), 200)
            )

    async def _publish_refused(self, message: EntryRefused) -> None:
        """Dead letter + ack; an error event for the producer only where no record of the id exists."""
        event = ErrorEvent(attempt=1, code=message.code, message=message.message, rejected_entry=message.entry_id)

        async def queue(pipe):
            self.streams.queue_dead_letter(
                pipe,
                message.stream,
                message.entry_id,
                f"{message.code}: {message.message}",
                message.fields,
                job_id=message.job_id,
                size=message.size,
                stub=message.stub,
            )
            if message.job_id and message.notify:
                await self.streams.queue_reject(pipe, message.job_id, message.entry_id, encode_event(event)["data"])

        replies = await self.streams.write(queue, "refuse entry")
        if any(isinstance(reply, ResponseError) for reply in replies):
            self.warnings.warning(
                "refusal",
                "refusing entry %s: %s",
                message.entry_id,
                shown(str(next(r for r in replies if isinstance(r, ResponseError))), 200),
            )
        await self.ledger.send(EntryDone(message.stream, message.entry_id))  # its bytes are ours no more

    def _token(self, delivery: Delivery, output: CompletionOutput) -> TokenEvent:
        seq = self.next_seq.get(delivery.job_id, 0)
        self.next_seq[delivery.job_id] = seq + 1
        logprobs = None
        if output.new_logprobs is not None and output.new_token_ids:
            # the step's own copy: by the time this runs, later steps may have grown `logprobs`
            logprobs = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top, "rank": lp.rank}
                for lp in output.new_logprobs
            ]
        resumed = delivery.resumed if seq == 0 else None  # the first event of a resumed attempt says so
        return TokenEvent(
            attempt=delivery.attempt,
            seq=seq,
            text=output.new_text,
            token_ids=output.new_token_ids,
            logprobs=logprobs,
            index=output.index,
            resumed_tokens=resumed and resumed[0],
            resumed_chars=resumed and resumed[1],
        )

    def _terminal(self, delivery: Delivery, output: RequestOutput, abort_reason: str | None):
        num_events = self.next_seq.pop(delivery.job_id, 0)
        if any(completion.finish_reason == "abort" for completion in output.outputs):  # all of an n > 1 job
            if abort_reason == "cancelled":
                return "cancelled", CancelledEvent(attempt=delivery.attempt, metadata=delivery.metadata)
            reason = abort_reason or "aborted"
            message = ABORT_MESSAGES.get(reason, f"job stopped: {reason}")
            return "error", ErrorEvent(
                attempt=delivery.attempt, code=reason, message=message, metadata=delivery.metadata
            )
        if any(completion.finish_reason == "error" for completion in output.outputs):  # e.g. a grammar's dead end
            return "error", ErrorEvent(
                attempt=delivery.attempt,
                code="invalid_request",
                message=output.error or "the job failed",
                metadata=delivery.metadata,
            )
        metrics = output.metrics
        usage = usage_of(output)
        timings = (
            Timings(queue=metrics.queue_time, ttft=metrics.ttft, tpot=metrics.tpot, e2e=metrics.e2e)
            if metrics
            else Timings()
        )
        first = output.outputs[0]
        read = [_tool_output(delivery, c.text, c.index) for c in output.outputs]
        choices = (
            [
                OutputChoice(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason, **tools)
                for c, tools in zip(output.outputs, read)
            ]
            if len(output.outputs) > 1
            else None
        )
        return "done", DoneEvent(
            attempt=delivery.attempt,
            seq=num_events,
            finish_reason=first.finish_reason,
            text=first.text,
            token_ids=first.token_ids,
            usage=usage,
            timings=timings,
            metadata=delivery.metadata,
            outputs=choices,
            resumed_tokens=delivery.resumed[0] if delivery.resumed else 0,
            **read[0],
        )

    @staticmethod
    def _ended_event(message: JobEnded):
        delivery = message.delivery
        if message.event_type == "cancelled":
            return CancelledEvent(attempt=delivery.attempt, metadata=delivery.metadata)
        return ErrorEvent(
            attempt=delivery.attempt, code=message.code, message=message.message, metadata=delivery.metadata
        )

    async def _release(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self.next_seq.pop(delivery.job_id, None)
            await self.ledger.send(Release(delivery))  # the ledger's mailbox never makes us wait


def _tool_output(delivery: Delivery, text: str, index: int) -> dict:
    """The tool calls read from one output of a job with tools (fields of its done event)."""
    if delivery.tools is None:
        return {}
    return delivery.tools.read(text, index).model_dump(exclude_none=True)


def usage_of(output: RequestOutput) -> Usage:
    """The tokens the engine served a request: its prompt (cached part too) and outputs."""
    prompt = len(output.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=output.num_output_tokens,
        total_tokens=prompt + output.num_output_tokens,
        cached_tokens=output.num_cached_tokens or 0,
    )
