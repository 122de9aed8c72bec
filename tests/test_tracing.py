"""One trace per job, producer to result (actors/tracing.py, clients/trace_context.py): real
`conveyor serve` replicas and the test's producer export over OTLP/HTTP to a receiver the
test runs (tests/otlp_receiver.py), decoded with OpenTelemetry's protocol messages."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from fault_harness import pending_owners, spawner_fixture, start_all, wait_until
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_receiver import OtlpReceiver

from conveyor.actors.tracing import tracing_configured
from conveyor.apps.openai_api.batch_runner import RunnerSettings
from conveyor.clients import Client
from conveyor.clients.keys import Keys
from conveyor.gateway import batch_routes

SERVER_KIND, CONSUMER_KIND, INTERNAL_KIND = 2, 5, 1  # OTLP's SpanKind numbers


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(request, tmp_path, redis_url)


@pytest.fixture
def producer(receiver):
    """The producer's own tracer (its application's provider), exporting to the same receiver."""
    provider = TracerProvider(resource=Resource.create({"service.name": "producer"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint + "/v1/traces")))
    yield provider.get_tracer("test-producer")
    provider.shutdown()


def traced(receiver, lease_s: float | None = None) -> dict:
    options = {"env": {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}}
    if lease_s is not None:
        options["lease_s"] = lease_s
    return options


def job(max_tokens: int = 12, **more) -> dict:
    return {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **more}


def span_hex(span) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def test_one_trace_holds_the_producer_span_and_the_replica_phases(
    spawn, tiny_model, redis_url, namespace, receiver, producer, raw
):
    start_all([spawn(namespace, "traced-a", tiny_model, **traced(receiver))])
    client = Client(redis_url, namespace=namespace)
    with producer.start_as_current_span("make summary") as span:
        handle = client.submit(**job(webhook=True))
    trace_id, producer_span_id = span_hex(span)
    result = handle.result(timeout=60)
    names = ("make summary", "queue ", "text_completion ", "prefill", "decode", "publish")
    wait_until(lambda: all(receiver.named(trace_id, n) for n in names), 30, "every span of the job's trace")

    [queued] = receiver.named(trace_id, "queue ")
    [attempt] = receiver.named(trace_id, "text_completion ")
    assert queued.parent_id == attempt.parent_id == producer_span_id
    assert queued.kind == attempt.kind == CONSUMER_KIND and queued.service == attempt.service == "conveyor-replica"
    stream = Keys(namespace).interactive
    for span in (queued, attempt):
        assert span.attributes["messaging.system"] == "redis"
        assert span.attributes["messaging.destination.name"] == stream
        assert span.attributes["messaging.message.id"] == raw.hget(Keys(namespace).job(handle.job_id), "entry").decode()
    assert queued.end_ns == attempt.start_ns  # the queue hop ends where the attempt starts
    a = attempt.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.model"] == Path(tiny_model).name
    assert a["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens == 4
    assert a["gen_ai.usage.output_tokens"] == result.usage.completion_tokens == 12
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["conveyor.attempt"] == 1
    phases = {name: receiver.named(trace_id, name)[0] for name in ("prefill", "decode", "publish")}
    assert all(p.parent_id == attempt.span_id for p in phases.values())
    assert phases["prefill"].attributes["gen_ai.usage.input_tokens"] == 4
    assert phases["decode"].attributes["gen_ai.usage.output_tokens"] == 12
    assert phases["prefill"].end_ns <= phases["decode"].start_ns + 1_000 <= phases["publish"].start_ns + 1_000
    assert attempt.start_ns <= phases["publish"].end_ns <= attempt.end_ns

    # the dashboard's record: where the attempt ran, its trace, the prompt's head
    names = ("replica:1", "trace:1", "prompt_head", "started:1")
    record = dict(zip(names, (v.decode() for v in raw.hmget(Keys(namespace).job(handle.job_id), names))))
    assert record["replica:1"] == "traced-a" and record["trace:1"] == trace_id
    assert record["prompt_head"] == "<4 prompt token ids>" and float(record["started:1"]) > 0
    # webhook: true queued the job's event for the gateway's sender (gateway/webhooks.py delivers it)
    [(_, fields)] = raw.xrange(Keys(namespace).webhooks)
    assert fields[b"type"] == b"job.completed" and fields[b"data_id"] == handle.job_id.encode()
    assert fields[b"id"].startswith(b"evt_")


@pytest.mark.slow
def test_a_job_reclaimed_after_kill_9_gets_a_second_trace_linked_to_the_first(
    spawn, tiny_model, redis_url, namespace, receiver, producer, raw
):
    pair = start_all([spawn(namespace, f"traced-{n}", tiny_model, **traced(receiver, lease_s=2.0)) for n in "bc"])
    client = Client(redis_url, namespace=namespace)
    with producer.start_as_current_span("submit long job") as span:
        handle = client.submit(**job(max_tokens=900))
    first_trace, producer_span_id = span_hex(span)
    wait_until(lambda: receiver.named(first_trace, "queue "), 60, "attempt 1 to start (its queue span)")
    owners = set(pending_owners(raw, namespace).values())
    victim = next(r for r in pair if r.consumer in owners)
    assert victim.kill9() == -9
    result = handle.result(timeout=120)
    assert result.attempt == 2

    key = Keys(namespace).job(handle.job_id)
    second_trace = wait_until(lambda: (raw.hget(key, "trace:2") or b"").decode(), 10, "attempt 2's trace id")
    assert second_trace != first_trace and len(second_trace) == 32
    wait_until(lambda: receiver.named(second_trace, "text_completion "), 30, "attempt 2's span")
    [retry] = receiver.named(second_trace, "text_completion ")
    assert retry.parent_id == "" and retry.attributes["conveyor.attempt"] == 2
    assert retry.links == [(first_trace, producer_span_id)]
    assert retry.attributes["gen_ai.usage.output_tokens"] == 900
    assert not receiver.named(second_trace, "queue ")  # the wait before the retry is not a queue hop
    assert [s.name for s in receiver.of_trace(first_trace) if s.name.startswith("text_completion")] == []
    assert raw.hget(key, "trace:1").decode() == first_trace


def test_no_otel_configuration_means_no_spans_and_no_trace_fields(
    spawn, tiny_model, redis_url, namespace, receiver, raw
):
    assert not tracing_configured({})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"})
    start_all([spawn(namespace, "untraced", tiny_model, env={"OTEL_EXPORTER_OTLP_ENDPOINT": ""})])
    client = Client(redis_url, namespace=namespace)
    before = len(receiver.spans)
    handle = client.submit(**job())  # no span active in the producer: no trace fields
    data = msgpack.unpackb(raw.xrange(Keys(namespace).interactive)[0][1][b"data"])
    assert "traceparent" not in data or data["traceparent"] is None
    handle.result(timeout=60)
    assert len(receiver.spans) == before
    assert raw.hget(Keys(namespace).job(handle.job_id), "trace:1") in (None, b"")
    assert raw.xlen(Keys(namespace).webhooks) == 0  # webhook not asked: nothing queued


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}, "traceparent"),
        ({"traceparent": "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "traceparent"),
        ({"traceparent": "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"}, "traceparent"),
        ({"traceparent": "x" * 100_000}, "traceparent"),
        ({"traceparent": 7}, "traceparent"),
        ({"tracestate": "k=v," * 200}, "tracestate"),
        ({"tracestate": "k=v\r\nX-Evil: 1"}, "tracestate"),
        ({"webhook": "https://attacker.example/hook"}, "webhook"),
    ],
)
def test_hostile_trace_fields_are_refused_naming_the_field(fields, named):
    from conveyor.clients.errors import InvalidJob
    from conveyor.clients.protocol import validate_job

    with pytest.raises(InvalidJob) as refused:
        validate_job({"prompt": "hi", **fields})
    assert refused.value.field == named


def test_the_gateway_continues_the_callers_trace_and_the_replica_joins_it(
    spawn, tiny_model, redis_url, namespace, receiver, producer, monkeypatch
):
    import httpx
    from gateway_harness import GatewayThread
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    start_all([spawn(namespace, "traced-gw", tiny_model, **traced(receiver))])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    gateway = GatewayThread(redis_url, namespace, extra_routers=(batch_routes.router,))
    gateway.server.config.app.state.batch_settings = RunnerSettings(lease_s=2.0, poll_s=0.05, scan_s=0.1)
    with gateway:
        with producer.start_as_current_span("caller") as span:
            headers: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(headers)
            answer = httpx.post(
                f"{gateway.url}/v1/completions",
                json={"model": Path(tiny_model).name, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0},
                headers=headers,
                timeout=60,
            )
        assert answer.status_code == 200, answer.text
        # hostile trace headers: malformed ids, a long tracestate; ignored (a new trace), never an error
        forged = {"traceparent": "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "tracestate": "k=" + "v" * 8000}
        hostile = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": Path(tiny_model).name, "prompt": [5, 6], "max_tokens": 2, "temperature": 0},
            headers=forged,
            timeout=60,
        )
        assert hostile.status_code == 200, hostile.text
        hostile_job = hostile.headers["x-conveyor-job-id"]
        batch_id = run_batch(gateway, Path(tiny_model).name)
    trace_id, caller_span_id = span_hex(span)
    wait_until(lambda: receiver.named(trace_id, "text_completion "), 30, "the replica's span in the caller's trace")
    [server] = receiver.named(trace_id, "POST ")
    assert server.service == "conveyor-gateway" and server.kind == SERVER_KIND
    assert server.name == "POST /v1/completions" and server.parent_id == caller_span_id
    assert server.attributes["http.response.status_code"] == 200
    [attempt] = receiver.named(trace_id, "text_completion ")
    assert attempt.parent_id == server.span_id and attempt.attributes["gen_ai.usage.output_tokens"] == 5

    # the hostile request's job: in a trace of its own, rooted at the gateway's span
    wait_until(lambda: replica_span_of(receiver, hostile_job), 30, "the hostile request's job span")
    job_span = replica_span_of(receiver, hostile_job)
    [root] = [s for s in receiver.of_trace(job_span.trace_id) if s.span_id == job_span.parent_id]
    assert root.name == "POST /v1/completions" and root.parent_id == "" and job_span.trace_id != trace_id

    # a batch: one trace per line, each rooted at its "batch line" span, the replica's under it
    def line_spans():
        with receiver.lock:
            return [
                s for s in receiver.spans if s.name == "batch line" and s.attributes["conveyor.batch_id"] == batch_id
            ]

    wait_until(lambda: len(line_spans()) == 2, 30, "a span per batch line")
    lines = line_spans()
    assert len({line.trace_id for line in lines}) == 2 and all(line.parent_id == "" for line in lines)
    assert {line.attributes["conveyor.custom_id"] for line in lines} == {"line-0", "line-1"}
    for line in lines:
        wait_until(lambda: receiver.named(line.trace_id, "text_completion "), 30, "the line's job in its trace")
        [job_span] = receiver.named(line.trace_id, "text_completion ")
        assert (
            job_span.parent_id == line.span_id
            and job_span.attributes["conveyor.job_id"] == line.attributes["conveyor.job_id"]
        )


def replica_span_of(receiver, job_id: str):
    with receiver.lock:
        return next((s for s in receiver.spans if s.attributes.get("conveyor.job_id") == job_id and s.kind == 5), None)


def run_batch(gateway, model: str) -> str:
    """A two-line batch through the real SDK, waited for; its id."""
    import json

    from gateway_harness import openai_client

    sdk = openai_client(gateway)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": [5, i], "max_tokens": 3},
        }
        for i in range(2)
    ]
    upload = sdk.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: sdk.batches.retrieve(batch.id).status == "completed", 60, "the batch to complete")
    return batch.id


def test_a_dead_lettered_or_failed_attempt_is_marked_on_its_span():
    """JobTracer on the SDK's in-memory exporter: a job that ends in a dead letter carries the
    event and an error status; a first attempt without a producer trace gets the chosen id."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from conveyor.actors.tracing import ChosenTraceIds, JobTracer
    from conveyor.clients.protocol import validate_job

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=ChosenTraceIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = JobTracer(provider, "ns", "model-x", "replica-1")
    job = validate_job({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    chosen = tracer.new_trace_id()
    spans = tracer.begin(job, "ns:requests:interactive", "1-0", 1, 1.0e9, chosen)
    assert spans.trace_id == chosen and spans.new_trace
    reason = "delivered 4 times (max_deliveries=3)"
    tracer.end(spans, "error", error="max_deliveries", dead_letter=reason)
    queued, attempt = exporter.get_finished_spans()
    assert queued.name == "queue ns:requests:interactive" and queued.start_time == int(1.0e9 * 1e9)
    assert attempt.name == "chat model-x" and attempt.attributes["gen_ai.operation.name"] == "chat"
    assert format(attempt.context.trace_id, "032x") == chosen == format(queued.context.trace_id, "032x")
    assert [(e.name, e.attributes["conveyor.dead_letter.reason"]) for e in attempt.events] == [
        ("conveyor.dead_letter", reason)
    ]
    assert attempt.status.status_code.name == "ERROR" and attempt.attributes["conveyor.status"] == "error"
    provider.shutdown()
