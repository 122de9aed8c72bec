"""Signed completion webhooks (docs/webhooks.md), end to end: a real Valkey, real HTTP receivers
(http.server in a thread), the gateway's sender (in a gateway thread, or alone on its own loop),
the real OpenAI SDK against a gateway with a tiny model's replica, and signatures verified with
the Standard Webhooks reference library."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest
import redis
import redis.asyncio as aioredis
from fault_harness import wait_until
from gateway_harness import GatewayThread, openai_client
from replica_harness import ReplicaThread
from scratch import scratch_namespace
from standardwebhooks.webhooks import Webhook

from conveyor.apps.openai_api.batch_runner import RunnerSettings
from conveyor.clients.connection import resolve_settings
from conveyor.clients.keys import Keys
from conveyor.clients.webhook_queue import WEBHOOK_GROUP, queue_event
from conveyor.gateway import batch_routes, responses
from conveyor.gateway.cli import main as gateway_main
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.tenants import Grant
from conveyor.gateway.webhook_config import WebhookTarget, webhook_targets
from conveyor.gateway.webhooks import WebhookSender

MODEL = "tiny"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
KEY = bytes(range(32))
FAST_BATCHES = RunnerSettings(lease_s=2.0, poll_s=0.05, scan_s=0.1)
BIG_ANSWER = 50 << 20


# ---------------------------------------------------------------- a receiver


class Receiver:
    """An HTTP server in a thread: records every request, answers with `answer(handler, n)`
    (n: the number of this request at this receiver, from 1)."""

    def __init__(self, answer: Callable | None = None) -> None:
        self.answer = answer or ok
        self.requests: list[dict] = []
        self.release = threading.Event()  # ends the hanging answers
        self.sent: list[int] = []  # bytes of big answers written before the client left
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
                receiver.answer(self, len(receiver.requests))

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def events(self, path: str | None = None) -> list[dict]:
        return [json.loads(r["body"]) for r in self.requests if path is None or r["path"] == path]

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def ok(handler: BaseHTTPRequestHandler, n: int) -> None:
    _answer(handler, 200, b"ok")


def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
    handler.send_response(status)
    handler.send_header("content-length", str(len(body)))
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def hang(receiver: Receiver) -> Callable:
    def answer(handler: BaseHTTPRequestHandler, n: int) -> None:
        receiver.release.wait(60)  # accepts, reads the request, never answers
        handler.close_connection = True

    return answer


def verified(request: dict) -> dict:
    """The event of a request whose Standard Webhooks signature verifies (raises otherwise)."""
    headers = {k.lower(): v for k, v in request["headers"].items()}
    return Webhook(SECRET).verify(request["body"], headers)


# ---------------------------------------------------------------- a sender on its own loop


class SenderThread:
    """A WebhookSender (as a gateway runs it) on an event loop in a thread."""

    def __init__(self, redis_url: str, targets: dict[str, WebhookTarget], claim_idle_s: float = 60.0) -> None:
        self.redis_url, self.targets, self.claim_idle_s = redis_url, targets, claim_idle_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def _call(self, coroutine, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __enter__(self) -> SenderThread:
        self.thread.start()

        async def start() -> None:
            self.redis = aioredis.Redis.from_url(self.redis_url)
            targets = {ns: (Keys(ns), target) for ns, target in self.targets.items()}
            self.sender = WebhookSender(self.redis, targets, claim_idle_s=self.claim_idle_s)
            self.sender.start()

        self._call(start())
        return self

    def stop(self) -> None:
        async def stop() -> None:
            await self.sender.stop()
            await self.redis.aclose()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __exit__(self, *exc_info) -> None:
        if self.thread.is_alive():
            self.stop()


def target(url: str, **pacing) -> WebhookTarget:
    return WebhookTarget(url=url, key=KEY, **pacing)


def dead_letters(raw: redis.Redis, ns: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw.xrange(Keys(ns).webhooks_dead)]


def settled(raw: redis.Redis, ns: str) -> bool:
    """Nothing left in the events stream, nothing pending in its group."""
    return raw.xlen(Keys(ns).webhooks) == 0 and raw.xpending(Keys(ns).webhooks, WEBHOOK_GROUP)["pending"] == 0


@pytest.fixture
def ns2(redis_url):
    with scratch_namespace(redis_url, "hook") as namespace:
        yield namespace


# ---------------------------------------------------------------- through a gateway


@pytest.fixture(scope="module")
def gateway_ns(redis_url):
    with scratch_namespace(redis_url, "hooked") as namespace:
        yield namespace


@pytest.fixture(scope="module")
def hook(gateway_ns):
    with Receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(tiny_model, redis_url, gateway_ns, hook, tmp_path_factory, one_torch_thread):
    """A tiny model's replica and a gateway (Batch API, Responses) whose namespace has a webhook."""
    secret_file = tmp_path_factory.mktemp("hook") / "secret"
    secret_file.write_text(SECRET + "\n")
    with ReplicaThread(
        tiny_model, redis_url, gateway_ns, consumer="hook-replica", served_model_name=MODEL, kv_cache_memory="64MiB"
    ):
        gateway = GatewayThread(
            redis_url,
            gateway_ns,
            extra_routers=(batch_routes.router, responses.router),
            webhook_url=hook.url,
            webhook_secret_file=str(secret_file),
        )
        gateway.server.config.app.state.batch_settings = FAST_BATCHES
        with gateway:
            sdk = openai_client(gateway)
            wait_until(lambda: any(m.id == MODEL for m in sdk.models.list().data), 30, "the model to be live")
            yield sdk


def test_a_batch_sends_one_signed_batch_completed_event(stack, hook, gateway_ns, redis_client):
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"x{i}", "max_tokens": 3},
        }
        for i in range(2)
    ]
    upload = stack.files.create(
        file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch"
    )
    batch = stack.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")

    def batch_events() -> list[dict]:
        return [r for r in hook.requests if json.loads(r["body"])["data"]["id"] == batch.id]

    wait_until(batch_events, 60, "the batch's webhook event")
    time.sleep(1.0)  # a second event would come within the runner's scans
    (request,) = batch_events()
    event = verified(request)
    assert event["type"] == "batch.completed"
    assert set(event) == {"id", "object", "type", "created_at", "data"} and event["object"] == "event"
    assert event["data"] == {"id": batch.id} and event["id"] == request["headers"]["webhook-id"]
    assert request["headers"]["user-agent"].startswith("Conveyor-Webhooks/")
    assert request["headers"]["content-type"] == "application/json"
    assert stack.batches.retrieve(batch.id).status == "completed"
    wait_until(lambda: settled(redis_client, gateway_ns), 10, "the event to leave the stream")


def test_a_background_response_and_a_queued_job_event_are_delivered_signed(stack, hook, gateway_ns, redis_client):
    # a random tiny model never ends by itself: a stop string from its own greedy text ends it (completed)
    probe = stack.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0, store=False)
    stop = {"stop": [probe.output_text[:2]]} if probe.output_text.strip() else {}
    response = stack.responses.create(
        model=MODEL, input="Hi", background=True, max_output_tokens=6, temperature=0, extra_body=stop
    )
    queue_event(redis_client, Keys(gateway_ns).webhooks, "job.completed", "job-by-hand")  # as a replica queues it

    def of(data_id: str) -> list[dict]:
        return [r for r in hook.requests if json.loads(r["body"])["data"]["id"] == data_id]

    wait_until(lambda: of(response.id), 60, "response.completed, with no GET")  # noticed by the settler
    wait_until(lambda: of("job-by-hand"), 20, "the job event")
    time.sleep(1.5)  # settler rounds after the first: no second event
    (completed,) = of(response.id)
    assert verified(completed)["type"] == "response.completed"
    assert stack.responses.retrieve(response.id).status == "completed"
    (job,) = of("job-by-hand")
    assert verified(job)["type"] == "job.completed"


# ---------------------------------------------------------------- the sender alone


def test_a_failing_receiver_gets_the_event_again_until_it_takes_it(redis_url, namespace, redis_client):
    def twice_500(handler, n):
        _answer(handler, 500 if n <= 2 else 200, b"not now" if n <= 2 else b"ok")

    with Receiver(twice_500) as receiver, SenderThread(redis_url, {namespace: target(receiver.url)}):
        queue_event(redis_client, Keys(namespace).webhooks, "job.failed", "job-1")
        wait_until(lambda: len(receiver.requests) >= 3, 20, "three attempts")
        wait_until(lambda: settled(redis_client, namespace), 10, "the event to be settled")
        time.sleep(0.5)
    assert len(receiver.requests) == 3
    assert len({r["headers"]["webhook-id"] for r in receiver.requests}) == 1  # one event id on every retry
    assert all(verified(r)["data"] == {"id": "job-1"} for r in receiver.requests)
    assert dead_letters(redis_client, namespace) == []


def test_a_hanging_receiver_delays_no_other_namespace_and_ends_in_dead_letters(redis_url, namespace, ns2, redis_client):
    with Receiver() as hanging, Receiver() as good:
        hanging.answer = hang(hanging)
        targets = {
            namespace: target(hanging.url, timeout_s=5.0, retry_for_s=1.0, concurrency=2),
            ns2: target(good.url),
        }
        with SenderThread(redis_url, targets):
            for i in range(2):  # as many as its slots: all of them held
                queue_event(redis_client, Keys(namespace).webhooks, "job.completed", f"stuck-{i}")
            wait_until(lambda: len(hanging.requests) == 2, 10, "both slots of the hanging namespace taken")
            queue_event(redis_client, Keys(ns2).webhooks, "job.completed", "quick")
            wait_until(lambda: good.requests, 10, "the other namespace's event")
            # delivered while both of the hanging namespace's attempts still hang (an order, not a time)
            assert dead_letters(redis_client, namespace) == [] and len(hanging.requests) == 2
            wait_until(lambda: len(dead_letters(redis_client, namespace)) == 2, 30, "two dead letters")
            wait_until(lambda: settled(redis_client, namespace), 10, "the stream emptied")
    dead = dead_letters(redis_client, namespace)
    assert {d["data_id"] for d in dead} == {"stuck-0", "stuck-1"}
    assert all(
        d["reason"] == "no answer within 5 s" and int(d["attempts"]) >= 1 and d["type"] == "job.completed" for d in dead
    )
    assert verified(good.requests[0])["data"] == {"id": "quick"}


def test_an_event_held_by_a_stopped_sender_is_delivered_by_the_next(redis_url, namespace, redis_client):
    with Receiver() as receiver:
        receiver.answer = hang(receiver)
        hooks = {namespace: target(receiver.url, timeout_s=30.0)}
        first = SenderThread(redis_url, hooks, claim_idle_s=1.0).__enter__()
        queue_event(redis_client, Keys(namespace).webhooks, "batch.completed", "batch_restart")
        wait_until(lambda: receiver.requests, 10, "the first attempt")
        with SenderThread(redis_url, hooks, claim_idle_s=1.0):
            time.sleep(2.5)  # past claim_idle_s: the first sender keeps touching what it holds
            assert len(receiver.requests) == 1
            receiver.answer = ok
            first.stop()  # its attempt ends; the event stays pending, idle, and is taken over
            receiver.release.set()
            wait_until(lambda: len(receiver.requests) == 2, 15, "delivery by the second sender")
            wait_until(lambda: settled(redis_client, namespace), 10, "the event settled")
    assert receiver.requests[0]["headers"]["webhook-id"] == receiver.requests[1]["headers"]["webhook-id"]
    assert verified(receiver.requests[1])["type"] == "batch.completed"


def test_junk_entries_are_dead_lettered_and_a_wrong_type_key_is_survived(redis_url, namespace, ns2, redis_client):
    raw, stream = redis_client, Keys(namespace).webhooks
    junk = [
        {"foo": "bar"},
        {"id": "evt_1", "type": "nope", "created_at": "1", "data_id": "x"},
        {"id": "evt_2", "type": "job.completed", "created_at": "soon", "data_id": "x"},
        {"id": "evt_3", "type": "job.completed", "created_at": "1", "data_id": "x" * 1000},
        {"id": b"\xff\xfe", "type": "job.completed", "created_at": "1", "data_id": "x"},
    ]
    for fields in junk:
        raw.xadd(stream, fields)
    raw.set(Keys(ns2).webhooks, "not a stream")
    with Receiver() as receiver, Receiver() as other:
        with SenderThread(redis_url, {namespace: target(receiver.url), ns2: target(other.url)}):
            queue_event(raw, stream, "job.completed", "after-the-junk")
            wait_until(lambda: receiver.requests, 10, "the good event")
            wait_until(lambda: len(dead_letters(raw, namespace)) == len(junk), 10, "the junk dead-lettered")
            time.sleep(1.0)  # the other namespace's sender meets WRONGTYPE: it warns and backs off
            raw.delete(Keys(ns2).webhooks)
            queue_event(raw, Keys(ns2).webhooks, "job.completed", "after-the-fix")
            wait_until(lambda: other.requests, 20, "the other namespace's event once its key is a stream")
    assert [verified(r)["data"]["id"] for r in receiver.requests] == ["after-the-junk"]
    dead = dead_letters(raw, namespace)
    assert all(d["reason"].startswith("malformed event: ") and d["attempts"] == "0" for d in dead)
    assert any("'type'" in d["reason"] for d in dead) and any("'created_at'" in d["reason"] for d in dead)
    assert all(len(v) <= 200 for d in dead for v in d.values())


def test_a_huge_answer_and_a_redirect_cost_little_and_fail(redis_url, namespace, ns2, redis_client):
    def hostile(handler, n):
        if handler.path == "/huge":
            handler.send_response(500)
            handler.send_header("content-length", str(BIG_ANSWER))
            handler.end_headers()
            sent, chunk = 0, b"x" * 65536
            try:
                while sent < BIG_ANSWER:
                    handler.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            receiver.sent.append(sent)
        elif handler.path == "/moved":
            _answer(handler, 307, b"", location="/landed")
        else:
            _answer(handler, 200, b"ok")

    with Receiver(hostile) as receiver:
        base = receiver.url.rsplit("/", 1)[0]
        targets = {
            namespace: target(base + "/huge", retry_for_s=1.0),
            ns2: target(base + "/moved", retry_for_s=1.0),
        }
        with SenderThread(redis_url, targets):
            queue_event(redis_client, Keys(namespace).webhooks, "job.completed", "huge")
            queue_event(redis_client, Keys(ns2).webhooks, "job.completed", "moved")
            wait_until(lambda: dead_letters(redis_client, namespace), 30, "the huge answer's dead letter")
            wait_until(lambda: dead_letters(redis_client, ns2), 30, "the redirect's dead letter")
            wait_until(lambda: len(receiver.sent) == len(receiver.events("/huge")), 10, "the huge answers to end")
    (huge,) = dead_letters(redis_client, namespace)
    assert huge["reason"].startswith("HTTP 500: xxxx") and len(huge["reason"]) <= 200
    assert max(receiver.sent) < 16 << 20  # the client read a few KiB and left: no 50 MB read
    (moved,) = dead_letters(redis_client, ns2)
    assert moved["reason"].startswith("HTTP 307") and "not followed" in moved["reason"]
    assert receiver.events("/landed") == []  # never followed


# ---------------------------------------------------------------- configuration


def test_a_malformed_secret_or_address_is_refused_at_startup(redis_url, tmp_path, capsys):
    bad = tmp_path / "secret"
    for content in ("not-a-secret-value", "whsec_***not base64***", "whsec_" + base64.b64encode(b"short").decode()):
        bad.write_text(content)
        code = gateway_main(
            ["--redis-url", redis_url, "--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret-file", str(bad)]
        )
        error = capsys.readouterr().err
        assert code == 2 and str(bad) in error and "whsec_<base64" in error
        assert content not in error  # the secret is never shown
    for url in ("ftp://example.com/h", "http:///nohost", "http://exa mple.com/"):
        assert gateway_main(["--redis-url", redis_url, "--webhook-url", url]) == 2
        assert "--webhook-url" in capsys.readouterr().err

    good = tmp_path / "good"
    good.write_text(SECRET)
    redis_settings = resolve_settings(redis_url)
    settings = GatewaySettings(
        redis=redis_settings, webhook_url="https://hooks.example/all", webhook_secret_file=str(good)
    )
    grants = {
        "k1": Grant("team-a", webhook_url="https://a.example/hook"),
        "k2": Grant("team-a"),  # names none: the other key's URL is the namespace's
        "k3": Grant("team-b"),
    }
    targets = webhook_targets(settings, grants, ["team-a", "team-b"])
    assert targets["team-a"].url == "https://a.example/hook" and targets["team-b"].url == "https://hooks.example/all"
    assert targets["team-a"].key == KEY and "key=" not in repr(targets["team-a"])  # never printed
    grants["k4"] = Grant("team-a", webhook_url="https://elsewhere.example/")
    with pytest.raises(ValueError, match="namespace 'team-a'.*webhook_url"):
        webhook_targets(settings, grants, ["team-a", "team-b"])
    with pytest.raises(ValueError, match="no secret file"):
        webhook_targets(GatewaySettings(redis=redis_settings, webhook_url="https://hooks.example/"), {}, ["solo"])
    with pytest.raises(ValueError, match="webhook_url"):
        Grant("team-c", webhook_url="javascript:alert(1)")
