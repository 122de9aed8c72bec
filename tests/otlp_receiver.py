"""A real OTLP/HTTP trace receiver for tests: it decodes what exporters POST to /v1/traces
with OpenTelemetry's own protocol messages (opentelemetry-proto), as a collector would."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    status_code: int = 0


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(items) -> dict:
    return {item.key: _value(item.value) for item in items}


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _add(self, request) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            _attributes(span.attributes),
                            [(e.name, _attributes(e.attributes)) for e in span.events],
                            [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            span.status.code,
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def named(self, trace_id: str, name_prefix: str) -> list[ReceivedSpan]:
        return [span for span in self.of_trace(trace_id) if span.name.startswith(name_prefix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
