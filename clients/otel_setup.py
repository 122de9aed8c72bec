"""The OpenTelemetry SDK set up from the standard OTEL_* variables, for the replica's and the
gateway's spans (actors/tracing.py, gateway/tracing.py): OTLP over HTTP (the `otel` extra),
or gRPC where its exporter is installed, or the console. Nothing is imported, and nothing
traced, unless the variables ask for traces."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def tracing_configured(env: dict | None = None) -> bool:
    """Whether the OTEL_* variables ask for traces: an exporter endpoint or OTEL_TRACES_EXPORTER
    set, and neither OTEL_SDK_DISABLED nor OTEL_TRACES_EXPORTER=none."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(exporter or (endpoint or "").strip())


def tracer_provider_from_env(service_name: str, make_id_generator=None):
    """A private TracerProvider exporting as OTEL_* says, or None (not configured, or the SDK
    is not installed: one warning). Private: an application embedding a replica keeps its own."""
    if not tracing_configured():
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces but the OpenTelemetry SDK is missing: pip install 'conveyor[otel]'")
        return None
    exporter = _exporter()
    if exporter is None:
        return None
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}), id_generator=make_id_generator and make_id_generator()
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter():
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none): no traces", kind[:40])
        return None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        log.warning("OTLP over %s needs %s (pip install %s): no traces", protocol, package, package)
        return None
    return OTLPSpanExporter()
