"""The gateway's span of each API request (docs/tracing.md): it continues the caller's trace
(a W3C `traceparent` header) or starts one, and stays current while the request runs, so
the jobs it queues carry it (clients/trace_context.py) and the replica's spans join it.

Added only where OTEL_* asks for traces (clients/otel_setup.py decides, as for replicas)."""

from __future__ import annotations

import os
from typing import Any, Callable

from conveyor.clients.otel_setup import tracer_provider_from_env

TRACED_PREFIX = "/v1/"


_tracers: dict[tuple, object] = {}  # OTEL_* settings -> the tracer they gave (None: none)


def gateway_tracer():
    """The gateway's tracer (one provider per process and OTEL_* settings), or None when they
    ask for no traces."""
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("OTEL_")))
    if settings not in _tracers:
        provider = tracer_provider_from_env("conveyor-gateway")
        _tracers[settings] = None if provider is None else provider.get_tracer("conveyor.gateway")
    return _tracers[settings]


def tracing_middleware():
    """(TraceRequests, its options) for app.add_middleware, or None when not configured."""
    tracer = gateway_tracer()
    return None if tracer is None else (TraceRequests, {"tracer": tracer})


class TraceRequests:
    """Pure ASGI: one SERVER span per /v1/ request, named by its route's template."""

    def __init__(self, app: Any, tracer) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app, self.tracer = app, tracer
        self.context, self.trace, self.propagator = context, trace, TraceContextTextMapPropagator()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            return await self.app(scope, receive, send)
        # only the two W3C headers are read; the propagator checks their syntax
        headers = {
            name.decode("latin-1"): value.decode("latin-1")[:512]
            for name, value in scope.get("headers", ())
            if name in (b"traceparent", b"tracestate")
        }
        parent = self.propagator.extract(headers)
        method = scope.get("method", "")
        span = self.tracer.start_span(
            method,
            context=parent,
            kind=self.trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"][:256]},
        )
        status = 500

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = self.context.attach(self.trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, sending)
        finally:
            self.context.detach(token)
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
            span.end()
