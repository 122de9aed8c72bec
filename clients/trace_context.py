"""The producer's side of a job's trace: its current OpenTelemetry span context, written into
the job as W3C `traceparent`/`tracestate` (the replica continues the trace: actors/tracing.py).

Only OpenTelemetry's API is used, and only where the producer's application installed it:
without it, or with no span active, a job carries no trace fields and this costs one failed
import, once."""

from __future__ import annotations

_propagator = None  # the W3C Trace Context propagator, once OpenTelemetry's API was found
_missing = False


def current_trace_fields() -> dict[str, str]:
    """{'traceparent': ..., 'tracestate': ...} of the active span, or {} (none, or no OpenTelemetry)."""
    global _propagator, _missing
    if _missing:
        return {}
    if _propagator is None:
        try:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            _missing = True
            return {}
        _propagator = TraceContextTextMapPropagator()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)  # the active context's span: nothing when none is recording
    return {name: carrier[name] for name in ("traceparent", "tracestate") if carrier.get(name)}


def trace_fields_of(span) -> dict[str, str]:
    """{'traceparent': ..., 'tracestate': ...} naming `span` (an OpenTelemetry span), for a job
    that should continue it rather than whatever span is active."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return {name: carrier[name] for name in ("traceparent", "tracestate") if carrier.get(name)}
