"""OpenTelemetry spans of the jobs a replica runs (docs/tracing.md).

One trace per job, producer to result: the producer's span context travels in the job as
W3C ``traceparent``/``tracestate`` (clients/protocol.py checks their syntax, nothing more);
the replica continues it with a span for the time the entry waited in Redis (``queue``),
one for this replica's attempt, and under it ``prefill``, ``decode`` and ``publish``, with
the GenAI and messaging semantic conventions' attributes. A reclaimed job's new attempt is
a new trace linked to the producer's (a retry hours later does not stretch the first);
dead-lettering is an event on the attempt's span.

Configured by the standard OTEL_* variables (clients/otel_setup.py). With the SDK missing,
or no exporter configured, there is no tracer and the replica does no tracing work at all.

Spans are built from timestamps the replica and the engine core already record, mostly
once the job ends: tracing never sits on a step's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.clients.otel_setup import tracer_provider_from_env, tracing_configured  # noqa: F401 (re-exported)

INSTRUMENTATION = "conveyor"


def producer_context(traceparent: str | None, tracestate: str | None):
    """The OpenTelemetry context a job's traceparent/tracestate carry (an empty one without)."""
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not traceparent:
        return Context()
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    return TraceContextTextMapPropagator().extract(carrier)


def trace_id_of(traceparent: str | None) -> str:
    """The 32-hex trace id of a (checked) traceparent, or ''."""
    return traceparent.split("-")[1] if traceparent else ""


@dataclass
class JobSpans:
    """One attempt's open span (ended by ``JobTracer.end``) and its trace id."""

    attempt: Any
    trace_id: str
    new_trace: bool  # a reclaimed attempt's own trace (its id is not the producer's)


class ChosenTraceIds:
    """The replica's id generator: random ids, except that a trace it starts gets the id it
    chose beforehand (``chosen``), so the job's record names it in the same write that starts
    the attempt (START_LUA), without a second round trip."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self.random = RandomIdGenerator()
        self.chosen: int | None = None

    def generate_span_id(self) -> int:
        return self.random.generate_span_id()

    def is_trace_id_random(self) -> bool:  # W3C's "random" flag: chosen ids are drawn at random too
        return True

    def generate_trace_id(self) -> int:
        chosen, self.chosen = self.chosen, None
        return chosen or self.random.generate_trace_id()


class JobTracer:
    """Makes the spans of the jobs one replica (one namespace's door) runs."""

    def __init__(self, provider, namespace: str, model: str, consumer: str):
        from opentelemetry import trace

        self.trace = trace
        self.ids = provider.id_generator
        self.tracer = provider.get_tracer(INSTRUMENTATION)
        self.namespace, self.model, self.consumer = namespace, model, consumer

    def new_trace_id(self) -> str:
        """An id for a trace this replica may start (32 hex, never all zeros)."""
        return format(self.ids.random.generate_trace_id(), "032x")

    def begin(self, job, stream: str, entry_id: str, attempt: int, queued_at: float, new_trace: str) -> JobSpans:
        """At the start of an attempt: the attempt's span and (a first attempt's) the queue
        span, in the producer's trace, or in a new one with id ``new_trace`` whose root is the
        attempt (a retry, linked to the producer's span; or a job sent without a trace)."""
        trace = self.trace
        parent = producer_context(job.traceparent, job.tracestate)
        producer_span = trace.get_current_span(parent).get_span_context()
        messaging = {
            "messaging.system": "redis",
            "messaging.destination.name": stream,
            "messaging.message.id": entry_id,
            "messaging.operation.type": "process",
            "conveyor.job_id": job.job_id,
            "conveyor.namespace": self.namespace,
        }
        links = []
        if attempt > 1 and producer_span.is_valid:  # a retry: a trace of its own, linked to the first
            links = [trace.Link(producer_span, {"conveyor.link": "first attempt"})]
        own_trace = attempt > 1 or not producer_span.is_valid
        if own_trace:
            from opentelemetry.context import Context

            parent = Context()
            self.ids.chosen = int(new_trace, 16)  # the root's trace: the id on the job's record
        span = self._attempt_span(job, parent, links, messaging, attempt)
        if attempt == 1:  # the wait in Redis: beside the attempt, or under it when it is the root
            queue_parent = trace.set_span_in_context(span) if own_trace else parent
            queued = self.tracer.start_span(
                f"queue {stream}",
                context=queue_parent,
                kind=trace.SpanKind.CONSUMER,
                start_time=_ns(queued_at),
                attributes=messaging,
            )
            queued.end(end_time=span.start_time)  # the wait ends where the attempt begins
        return JobSpans(span, format(span.get_span_context().trace_id, "032x"), new_trace=own_trace)

    def _attempt_span(self, job, parent, links: list, messaging: dict, attempt: int):
        operation = "chat" if job.messages is not None else "text_completion"
        return self.tracer.start_span(
            f"{operation} {job.model or self.model}",
            context=parent,
            kind=self.trace.SpanKind.CONSUMER,
            links=links,
            attributes={
                **messaging,
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": job.model or self.model,
                "gen_ai.request.max_tokens": job.max_tokens,
                "gen_ai.request.temperature": job.temperature,
                "conveyor.attempt": attempt,
                "conveyor.replica": self.consumer,
                "conveyor.priority_class": job.priority_class,
            },
        )

    def end(
        self,
        spans: JobSpans,
        status: str,
        output=None,
        usage=None,
        error: str | None = None,
        dead_letter: str | None = None,
        published: tuple[float, float] | None = None,
    ) -> None:
        """The attempt ended (``status``: done, error, cancelled): its phases from the engine's
        timestamps (``output.metrics``), its usage and finish reasons, then the span's end."""
        span = spans.attempt
        context = self.trace.set_span_in_context(span)
        metrics = getattr(output, "metrics", None)
        if metrics is not None and metrics.ttft is not None:
            self._phases(context, metrics, usage)
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            span.set_attribute("conveyor.usage.cached_tokens", usage.cached_tokens)
        if output is not None:
            reasons = [c.finish_reason or "" for c in output.outputs]
            span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if published is not None:
            publish = self.tracer.start_span("publish", context=context, start_time=_ns(published[0]))
            publish.end(end_time=_ns(published[1]))
        if dead_letter is not None:
            span.add_event("conveyor.dead_letter", {"conveyor.dead_letter.reason": dead_letter[:500]})
        span.set_attribute("conveyor.status", status)
        if status == "error":
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, (error or "")[:500]))
        span.end()

    def _phases(self, context, metrics, usage) -> None:
        arrival = metrics.arrival_time
        scheduled = arrival + (metrics.queue_time or 0.0)
        first_token = arrival + metrics.ttft
        prefill = self.tracer.start_span("prefill", context=context, start_time=_ns(scheduled))
        prefill.set_attribute("conveyor.ttft_s", metrics.ttft)
        if usage is not None:
            prefill.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            prefill.set_attribute("conveyor.usage.cached_tokens", usage.cached_tokens)
        prefill.end(end_time=_ns(first_token))
        if metrics.e2e is not None:
            decode = self.tracer.start_span("decode", context=context, start_time=_ns(first_token))
            if usage is not None:
                decode.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            if metrics.tpot is not None:
                decode.set_attribute("conveyor.tpot_s", metrics.tpot)
            decode.end(end_time=_ns(arrival + metrics.e2e))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
