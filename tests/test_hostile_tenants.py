"""Hostile tenants at the HTTP front, against a real `conveyor gateway` process (three API
keys, two tenants), a password-protected Valkey and a real replica of a tiny model.

Each attack checks: the answer is a clear 4xx naming the limit (never a 500, never a
traceback in the gateway's log); the gateway's memory (psutil RSS, sampled during the
attack) grows by at most RSS_BOUND_MB; and a normal chat of tenant B answers before and
after (its latency is printed: `pytest -s` shows the table; no timing is asserted beyond
generous bounds). The ACL lines of docs/security.md are checked with ACL DRYRUN on a single
server and on a cluster node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from fault_harness import wait_until
from gateway_harness import GatewayProcess
from replica_harness import ReplicaThread

from conveyor.actors.embedded_valkey import EmbeddedValkey
from conveyor.apps.openai_api.batch_runner import FairShare
from conveyor.clients.keys import Keys

REPO_ROOT = Path(__file__).resolve().parents[1]
PASSWORD = secrets.token_urlsafe(18)
KEYS = {"key-a1": "a", "key-a2": "a", "key-b": "b"}  # two keys of tenant A, one of B
MODEL = "tiny"
RSS_BOUND_MB = 96  # an oversized input may cost the gateway at most this (its limits: 16 + 65 MiB)
FAIR_BOUND_S = 10.0  # B's batch starts within one scan (0.2 s here); generous on a shared box
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 2.0, 8.0, 60  # a 65 MB body arrives in 8 s
MAX_SAMPLES, MAX_TOTAL_TOKENS = 4, 64
MAX_REQUESTS_PER_TENANT = 8
LATENCY: dict[str, list[float]] = {}  # attack -> baseline chat latencies (ms) before and after


# ------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    server = EmbeddedValkey(tmp_path_factory.mktemp("hostile_valkey"), password=PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tenants() -> dict[str, str]:
    return {name: f"hostile-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b")}


@pytest.fixture(scope="module")
def admin(valkey):
    client = redis.Redis(port=valkey.port, password=PASSWORD)
    yield client
    client.close()


@pytest.fixture(scope="module")
def replica(tiny_model, valkey, tenants, admin, one_torch_thread):
    """Serves tenant B's namespace (A's batches only need to flood the runners)."""
    url = f"redis://:{PASSWORD}@127.0.0.1:{valkey.port}"
    with ReplicaThread(
        tiny_model,
        url,
        tenants["b"],
        consumer="hostile-replica",
        served_model_name=MODEL,
        max_num_seqs=8,
        kv_cache_memory="64MiB",
    ) as running:
        wait_until(lambda: admin.exists(Keys(tenants["b"]).model_info(MODEL)), 60, "model info")
        yield running


@pytest.fixture(scope="module")
def gateway(valkey, tenants, replica, tmp_path_factory):
    keys = {key: tenants[name] for key, name in KEYS.items()}
    env = {
        "REDIS_PASSWORD": PASSWORD,
        "CONVEYOR_BATCH_SCAN_S": "0.2",
        "CONVEYOR_BATCH_POLL_S": "0.1",
        "CONVEYOR_BATCH_LEASE_S": "3",
        "CONVEYOR_BATCH_CANCEL_WAIT_S": "2",
        "CONVEYOR_GATEWAY_MODEL_CACHE_S": "0.2",
        "TMPDIR": str(tmp_path_factory.mktemp("gateway_tmp")),
    }
    args = [
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--max-samples",
        str(MAX_SAMPLES),
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--max-requests-per-tenant",
        str(MAX_REQUESTS_PER_TENANT),
    ]
    with GatewayProcess(valkey.url, tmp_path_factory.mktemp("gateway_log"), keys=keys, args=args, env=env) as running:
        running.tmpdir = Path(env["TMPDIR"])
        wait_until(lambda: chat(running).status_code == 200, 60, "a first chat through the gateway")
        yield running
    print_latency_table()


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(gateway, key: str = "key-b", **body) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
        **body,
    }
    return httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers(key), timeout=120)


# ------------------------------------------------------------------ what every attack checks


class Watch:
    """Around one attack: the baseline chat's latency before and after, the gateway's peak
    RSS (sampled every 20 ms), and afterwards no 500 and no traceback."""

    def __init__(self, gateway, name: str) -> None:
        self.gateway, self.name = gateway, name
        self.process = psutil.Process(gateway.process.pid)
        self.peak = self.base = 0
        self._stop = threading.Event()

    def __enter__(self) -> Watch:
        LATENCY[self.name] = [baseline_ms(self.gateway)]
        self.base = self.peak = self.process.memory_info().rss
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._sampler.join()
        if exc_info[0] is not None:
            return
        LATENCY[self.name].append(baseline_ms(self.gateway))
        grown_mb = (self.peak - self.base) / 2**20
        assert grown_mb <= RSS_BOUND_MB, f"{self.name}: the gateway grew {grown_mb:.0f} MB (bound {RSS_BOUND_MB})"
        no_500_no_traceback(self.gateway)


def baseline_ms(gateway) -> float:
    """One normal chat of tenant B (4 tokens), in ms."""
    started = time.perf_counter()
    reply = chat(gateway)
    assert reply.status_code == 200, reply.text
    return (time.perf_counter() - started) * 1000


def no_500_no_traceback(gateway) -> None:
    log = gateway.log_text()
    assert "Traceback" not in log, log[-3000:]
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    assert not re.search(r'conveyor_gateway_requests_total\{[^}]*status="500"', metrics), metrics


def print_latency_table() -> None:
    print("\nbaseline chat latency (one 4-token chat of tenant B, ms) before -> after each attack:")
    for name, (before, after) in ((n, v) for n, v in LATENCY.items() if len(v) == 2):
        print(f"  {name:<44} {before:8.1f} -> {after:8.1f}  ({after / before:.2f}x)")


def error_of(reply: httpx.Response) -> dict:
    return reply.json()["error"]


# ------------------------------------------------------------------ raw HTTP


def send_slowly(gateway, head: bytes, chunks, pause_s: float = 0.0) -> tuple[int | None, int]:
    """Send `head` then each chunk on a raw socket until the server answers or closes:
    (status or None, body bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.sendall(head)
        for chunk in chunks:
            status = _answered(sock)
            if status is not False:
                return status, sent
            try:
                sock.sendall(chunk)
            except OSError:
                return _answered(sock, wait_s=5) or None, sent
            sent += len(chunk)
            time.sleep(pause_s)
        return _answered(sock, wait_s=30) or None, sent


def _answered(sock: socket.socket, wait_s: float = 0.0) -> int | None | bool:
    """The response's status once one came, None when the server closed without one, False: nothing yet."""
    sock.settimeout(wait_s or 0.0001)
    try:
        data = sock.recv(65536)
    except (BlockingIOError, socket.timeout, TimeoutError):
        return False
    except OSError:
        return None
    finally:
        sock.settimeout(60)
    if not data:
        return None
    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(match.group(1)) if match else None


def chunked(total: int, size: int = 1 << 20, fill: bytes = b"[") -> list[bytes]:
    """`total` bytes of body as HTTP/1.1 chunks (generated lazily by the caller's iteration)."""
    return (b"%x\r\n%s\r\n" % (size, fill * size) for _ in range(total // size))  # type: ignore[return-value]


def post_head(path: str, key: str, content_type: str, length: int | None = None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: {content_type}\r\n{framing}\r\n\r\n"
    ).encode()


# ------------------------------------------------------------------ batches: fairness, depth, cancel


def upload(gateway, key: str, lines: list[dict] | bytes) -> str:
    content = lines if isinstance(lines, bytes) else b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    reply = httpx.post(
        f"{gateway.base_url}/files",
        headers=headers(key),
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", content)},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["id"]


def create_batch(gateway, key: str, file_id: str) -> dict:
    reply = httpx.post(
        f"{gateway.base_url}/batches",
        headers=headers(key),
        timeout=60,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def batch_status(gateway, key: str, batch_id: str) -> str:
    return httpx.get(f"{gateway.base_url}/batches/{batch_id}", headers=headers(key), timeout=60).json()["status"]


def chat_line(i: int) -> dict:
    return {
        "custom_id": f"r{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"n{i}"}], "max_tokens": 2},
    }


def test_tenant_b_batch_starts_within_the_bound_while_a_floods(gateway):
    with Watch(gateway, "4 x 300-line batches of tenant A"):
        flood = [
            create_batch(
                gateway, "key-a1" if i % 2 else "key-a2", upload(gateway, "key-a1", [chat_line(j) for j in range(300)])
            )["id"]
            for i in range(4)
        ]
        wait_until(
            lambda: sum(batch_status(gateway, "key-a1", b) == "in_progress" for b in flood) >= 2,
            60,
            "A's batches to run",
        )
        created = time.monotonic()
        mine = create_batch(gateway, "key-b", upload(gateway, "key-b", [chat_line(0)]))["id"]
        wait_until(lambda: batch_status(gateway, "key-b", mine) != "validating", FAIR_BOUND_S, "B's batch to start")
        started_s = time.monotonic() - created
        wait_until(lambda: batch_status(gateway, "key-b", mine) == "completed", 120, "B's batch to complete")
        print(f"\nB's batch left validating {started_s:.2f} s after its creation, with A's 4 batches active")
        for batch_id in flood:  # cancel always reaches `cancelled`
            httpx.post(f"{gateway.base_url}/batches/{batch_id}/cancel", headers=headers("key-a1"), timeout=60)
        wait_until(
            lambda: all(batch_status(gateway, "key-a1", b) == "cancelled" for b in flood),
            60,
            "A's batches to be cancelled",
        )


def test_fair_share_takes_turns_and_never_refuses_a_tenant_its_first_batch():
    share = FairShare(total=4, per_tenant=2)
    running = {("a", "a1"): None, ("a", "a2"): None, ("c", "c1"): None}
    assert not share.may_start("a", running), "a tenant's own cap"
    assert share.may_start("c", running)
    running[("d", "d1")] = None  # the total (4) is reached...
    assert not share.may_start("c", running)
    assert share.may_start("b", running), "...but a tenant driving none may always start one"
    order = share.order({"a": [("a3", False), ("a4", False)], "b": [("b1", False), ("b2", False)], "c": [("c3", True)]})
    assert order[0] == ("c", "c3", True), "a cancel first, whatever the counts"
    tenants_in_turn = [ns for ns, _, _ in order[1:]]
    assert tenants_in_turn in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), order


def test_a_line_nested_100000_deep_fails_its_batch_at_once(gateway):
    deep = (
        b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}\n"
    )
    with Watch(gateway, "batch line nested 100,000 deep"):
        batch = create_batch(gateway, "key-b", upload(gateway, "key-b", deep + json.dumps(chat_line(1)).encode()))
        wait_until(lambda: batch_status(gateway, "key-b", batch["id"]) == "failed", 30, "the batch to fail")
        errors = httpx.get(f"{gateway.base_url}/batches/{batch['id']}", headers=headers("key-b"), timeout=60).json()[
            "errors"
        ]["data"]
        assert errors[0]["line"] == 1 and "levels deep" in errors[0]["message"], errors
        cancelled = create_batch(gateway, "key-b", upload(gateway, "key-b", deep))
        httpx.post(f"{gateway.base_url}/batches/{cancelled['id']}/cancel", headers=headers("key-b"), timeout=60)
        wait_until(
            lambda: batch_status(gateway, "key-b", cancelled["id"]) in ("cancelled", "failed"),
            30,
            "the cancelled deep batch to end",
        )


# ------------------------------------------------------------------ bodies and uploads


def test_a_200mb_chunked_batch_body_is_cut_at_the_limit(gateway):
    with Watch(gateway, "200 MB chunked POST /v1/batches"):
        status, sent = send_slowly(gateway, post_head("/v1/batches", "key-a1", "application/json"), chunked(200 << 20))
        assert status == 413, status
        assert sent < 64 << 20, f"the gateway read {sent} bytes before refusing"


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/chat/completions"])
def test_a_200000_deep_json_body_is_a_400(gateway, path):
    with Watch(gateway, f"200,000-deep JSON on {path}"):
        reply = httpx.post(
            f"{gateway.url}{path}",
            content=b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
            headers={**headers("key-b"), "content-type": "application/json"},
            timeout=60,
        )
        assert reply.status_code == 400 and error_of(reply)["code"] == "json_too_deep", reply.text


def test_a_300mb_chunked_upload_is_cut_before_it_is_spooled(gateway):
    boundary = "hostileboundary"
    head = post_head("/v1/files", "key-a1", f"multipart/form-data; boundary={boundary}")
    preamble = (
        f'--{boundary}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
        'content-disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "content-type: application/octet-stream\r\n\r\n"
    ).encode()
    spooled = {"peak": 0}

    def chunks():
        yield b"%x\r\n%s\r\n" % (len(preamble), preamble)
        for number, chunk in enumerate(chunked(300 << 20, fill=b"x")):
            if number % 4 == 0:
                spooled["peak"] = max(spooled["peak"], spooled_bytes(gateway))
            yield chunk

    with Watch(gateway, "300 MB chunked upload"):
        status, sent = send_slowly(gateway, head, chunks())
        assert status == 413, status
        assert sent < 80 << 20 and spooled["peak"] < 80 << 20, (sent, spooled)


def spooled_bytes(gateway) -> int:
    """Bytes of the gateway's open files in its TMPDIR (spooled uploads are unlinked at once: seen through /proc)."""
    total, fds = 0, Path(f"/proc/{gateway.process.pid}/fd")
    for fd in fds.iterdir() if fds.exists() else ():
        try:
            if os.readlink(fd).startswith(str(gateway.tmpdir)):
                total += fd.stat().st_size
        except OSError:
            continue
    return total


# ------------------------------------------------------------------ slow and many connections


def test_slow_headers_and_bodies_are_cut_off(gateway):
    with Watch(gateway, "40 slowloris connections"):
        slow = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in range(40)]
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # and never the end of the headers
        ends = time.monotonic() + HEADER_TIMEOUT_S + 20
        for sock in slow:
            sock.settimeout(max(0.1, ends - time.monotonic()))
            assert sock.recv(100) == b"", "a connection that never finished its headers was kept"
            sock.close()
        status, _ = send_slowly(
            gateway, post_head("/v1/chat/completions", "key-b", "application/json", 100), [b"{"] * 100, pause_s=0.2
        )
        assert status == 408, status


def test_a_tenant_holding_its_share_of_requests_leaves_the_others_theirs(gateway):
    with Watch(gateway, f"tenant A holding {MAX_REQUESTS_PER_TENANT} slow requests"):
        slow = []
        for i in range(MAX_REQUESTS_PER_TENANT):  # both of A's keys count together
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
            sock.sendall(post_head("/v1/chat/completions", f"key-a{1 + i % 2}", "application/json", 100) + b"{")
            slow.append(sock)
        time.sleep(0.5)
        refused = httpx.post(f"{gateway.base_url}/chat/completions", headers=headers("key-a1"), json={}, timeout=30)
        assert refused.status_code == 429 and error_of(refused)["code"] == "tenant_busy", refused.text
        assert chat(gateway).status_code == 200, "tenant B is served meanwhile"
        for sock in slow:
            sock.close()
        wait_until(
            lambda: httpx.post(
                f"{gateway.base_url}/chat/completions", headers=headers("key-a1"), json={}, timeout=30
            ).status_code
            == 400,
            30,
            "A's share to be free again",
        )


def test_connections_over_the_cap_get_503(gateway):
    with Watch(gateway, f"{MAX_CONNECTIONS + 20} idle connections"):
        idle = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in range(MAX_CONNECTIONS + 20)]
        time.sleep(0.5)
        refused = sum(_answered(sock, wait_s=0.2) == 503 for sock in idle)
        for sock in idle:
            sock.close()
        assert refused >= 20, refused
        wait_until(lambda: httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200, 30, "health")


# ------------------------------------------------------------------ work per request


def test_n_and_n_times_max_tokens_are_capped(gateway):
    with Watch(gateway, f"n={MAX_SAMPLES + 1}, n x max_tokens over {MAX_TOTAL_TOKENS}"):
        reply = chat(gateway, n=MAX_SAMPLES + 1, temperature=1.0)
        assert reply.status_code == 400 and error_of(reply)["param"] == "n", reply.text
        assert f"limit of {MAX_SAMPLES}" in error_of(reply)["message"]
        reply = chat(gateway, n=MAX_SAMPLES, max_completion_tokens=MAX_TOTAL_TOKENS, temperature=1.0)
        assert reply.status_code == 400 and error_of(reply)["param"] == "max_completion_tokens", reply.text
        assert f"limit of {MAX_TOTAL_TOKENS}" in error_of(reply)["message"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": MAX_SAMPLES, "temperature": 1}
        reply = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers("key-b"), timeout=120)
        assert reply.status_code == 200, reply.text  # no max_tokens: its share of the total, not a 400
        assert reply.json()["usage"]["completion_tokens"] <= MAX_TOTAL_TOKENS


# ------------------------------------------------------------------ model info


@pytest.fixture
def model_info(admin, tenants):
    """Tenant B's model info hash, restored after the test rewrites it (as any writer of the namespace can)."""
    key = Keys(tenants["b"]).model_info(MODEL)
    saved = admin.hgetall(key)
    yield key
    admin.delete(key)
    admin.hset(key, mapping=saved)
    admin.expire(key, 3600)


def test_a_template_that_renders_one_token_does_not_break_chats(gateway, admin, model_info):
    admin.hset(model_info, "chat_template", "x")
    with Watch(gateway, "chat template rendering one token"):
        time.sleep(0.5)  # the gateway's model cache (0.2 s here)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a longer question " * 20}]}
        reply = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers("key-b"), timeout=120)
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 300000000 }}",
        "{% for i in range(100000) %}{{ 'y' * 3000 }}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "x" * (300 << 10),
    ],
)
def test_a_template_bomb_costs_bounded_time_and_memory(gateway, admin, model_info, template):
    admin.hset(model_info, "chat_template", template)
    with Watch(gateway, f"template bomb {template[:24]!r}"):
        time.sleep(0.5)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers("key-b"), timeout=120)
        assert reply.status_code in (200, 400), reply.text  # the replica renders the template itself
        started = time.perf_counter()
        assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
        assert time.perf_counter() - started < 5


def test_an_oversized_tokenizer_is_never_read(gateway, admin, model_info):
    bloated = b"x" * (65 << 20)  # over model_info.MAX_TOKENIZER_BYTES
    admin.hset(model_info, mapping={"tokenizer_json": bloated, "tokenizer_sha256": hashlib.sha256(bloated).hexdigest()})
    with Watch(gateway, "65 MiB tokenizer_json"):
        time.sleep(0.5)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers("key-b"), timeout=120)
        assert reply.status_code == 200, reply.text  # no count: the job's default max_tokens
        reply = chat(gateway, logprobs=True)
        assert reply.status_code == 400 and error_of(reply)["param"] == "logprobs", reply.text


def test_oversized_small_fields_of_a_model_record_are_never_read(gateway, admin, model_info):
    """The gateway's model directory measures each small field (HSTRLEN) before it reads it: a
    30 MB lora_adapters or published_at costs nothing and the model stays served."""
    admin.hset(model_info, mapping={"lora_adapters": b"[" * (30 << 20), "published_at": b"9" * (30 << 20)})
    with Watch(gateway, "30 MB lora_adapters and published_at"):
        time.sleep(0.5)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers("key-b"), timeout=120)
        assert reply.status_code == 200, reply.text


# ------------------------------------------------------------------ ACL lines (docs/security.md)


def documented_acl(user: str, ns: str) -> list[str]:
    """The rules of `ACL SETUSER <user>` in docs/security.md, for namespace `ns`, password dropped."""
    doc = (REPO_ROOT / "docs" / "security.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith(f"ACL SETUSER {user} "))
    return [rule.replace("tenant-a", ns) for rule in line.split()[3:] if not rule.startswith(">")]


SINGLE = {
    "allowed": [
        ("XADD", "{ns}:requests:interactive", "*", "f", "v"),
        ("HSET", "{ns}:job:j1", "f", "v"),
        ("XREAD", "STREAMS", "{ns}:out:j1", "0"),
        ("HSET", "{ns}:limits", "f", "v"),
        ("HMGET", "{ns}:model:m", "name"),
        ("HSTRLEN", "{ns}:model:m", "chat_template"),
        ("SMEMBERS", "{ns}:models"),
        ("XLEN", "{ns}:dead"),
        ("PUBLISH", "{ns}:cancel", "j1"),
    ],
    "denied": [
        ("HSET", "{ns}:model:m", "chat_template", "x"),
        ("SADD", "{ns}:models", "m"),
        ("XADD", "{ns}:dead", "*", "f", "v"),
        ("HSET", "{other}:job:j1", "f", "v"),
        ("XADD", "{other}:requests:interactive", "*", "f", "v"),
        ("PUBLISH", "{other}:cancel", "j1"),
        ("HGETALL", "{other}:model:m"),
        ("SCAN", "0"),
    ],
}
CLUSTER = {
    "allowed": [
        ("XADD", "{ns}:{p0}:requests:interactive", "*", "f", "v"),
        ("XADD", "{ns}:{p3}:requests:batch:m", "*", "f", "v"),
        ("HSET", "{ns}:{p1}:job:j1", "f", "v"),
        ("XREAD", "STREAMS", "{ns}:{p2}:out:j1", "0"),
        ("HSET", "{ns}:{p0}:limits", "f", "v"),
        ("HMGET", "{ns}:{{ns}}:model:m", "name"),
        ("SMEMBERS", "{ns}:{{ns}}:models"),
    ],
    "denied": [
        ("HSET", "{ns}:{{ns}}:model:m}:job:1", "f", "v"),
        ("HSET", "{ns}:{{ns}}:model:m", "f", "v"),
        ("HSET", "{ns}:{{ns}}:job:j1", "f", "v"),
        ("HSET", "{ns}:{px}:job:j1", "f", "v"),
        ("HSET", "{ns}:{p1}x:job:j1", "f", "v"),
        ("XADD", "{ns}:{p1}:dead", "*", "f", "v"),
        ("HSET", "{other}:{p0}:job:j1", "f", "v"),
        ("HSET", "{other}:job:j1", "f", "v"),
        ("SCAN", "0"),
    ],
}


def check_dryrun(client: redis.Redis, user: str, ns: str, shapes: dict) -> None:
    rules = documented_acl(user, ns)
    client.execute_command("ACL", "SETUSER", user, "reset", "on", "nopass", *rules)
    for verdict, commands in shapes.items():
        for command in commands:
            args = [
                arg.replace("{{ns}}", "{" + ns + "}").replace("{ns}", ns).replace("{other}", "payments-b")
                for arg in command
            ]
            answer = client.execute_command("ACL", "DRYRUN", user, *args)
            allowed = answer in (b"OK", "OK")
            assert allowed == (verdict == "allowed"), f"{user}: {' '.join(args)} -> {answer!r}"


def test_acl_lines_on_a_single_server(admin):
    check_dryrun(admin, "conveyor-producer-tenant-a", "payments", SINGLE)
    check_dryrun(
        admin,
        "conveyor-replica-tenant-a",
        "payments",
        {
            "allowed": [("XREADGROUP", "GROUP", "engines", "c", "STREAMS", "payments:requests:batch", ">")],
            "denied": [("XADD", "payments-b:requests:batch", "*", "f", "v")],
        },
    )


def started_cluster(directory: Path, attempts: int = 3):
    """A one-master cluster; tried again when a node drew a port over 55535 (its bus port
    is port + 10000, which Valkey refuses)."""
    from cluster_harness import ValkeyCluster

    from conveyor.actors.embedded_valkey import EmbeddedValkeyError

    for attempt in range(attempts):
        cluster = ValkeyCluster(directory / f"try{attempt}", masters=1)
        try:
            return cluster.start()
        except EmbeddedValkeyError:
            cluster.stop()
            if attempt == attempts - 1:
                raise


def test_acl_lines_on_a_cluster_node(tmp_path):
    cluster = started_cluster(tmp_path)
    node = redis.Redis(port=cluster.masters[0].port)
    try:
        check_dryrun(node, "conveyor-cluster-producer-tenant-a", "payments", CLUSTER)
        check_dryrun(
            node,
            "conveyor-cluster-replica-tenant-a",
            "payments",
            {
                "allowed": [("HSET", "payments:{payments}:model:m", "f", "v"), ("CLUSTER", "SLOTS")],
                "denied": [("HSET", "payments-b:{payments-b}:model:m", "f", "v")],
            },
        )
    finally:
        node.close()
        cluster.stop()
