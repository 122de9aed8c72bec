"""Issue 39, items 5 to 8, against real `conveyor gateway` processes on loopback, the session's
Valkey and real replicas of the tiny model (the openai SDK and httpx as clients):

5. stored responses: each tenant holds at most --max-stored-bytes (429 past it, 413 for one
   alone over it; deleted and expired responses leave the count), a background response
   whose job failed keeps no input, and compose's Redis has a maxmemory with noeviction;
6. connections: one address without a key holding idle sockets (and reopening them as they
   are closed) never keeps keyed requests out, from another address or its own;
7. DNS rebinding: a Host header the gateway does not answer to gets a 400 naming it;
8. /v1/responses gets the work caps of chat completions (--max-total-tokens, the share).

New options are given as environment variables, so the same tests run (and fail) against a
gateway that predates them. Floods are bounded in sockets and seconds, on 127.0.0.0/8 only.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis
import yaml
from fault_harness import wait_until
from gateway_harness import GatewayProcess, openai_client
from replica_harness import ReplicaThread

from conveyor.clients.keys import GROUP, Keys

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
STORED_LIMIT = 1 << 20  # --max-stored-bytes of these gateways
MAX_TOTAL_TOKENS = 64
BIG = 200_000  # characters of one large input: about 200 kB stored
# The connection cap of the flood tests. From its own address, a keyed request gets in when
# its headers arrive before the flood has reopened 3/4 of this many sockets (150 here).
MAX_CONNECTIONS = 200


# ------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def tenants() -> dict[str, str]:
    # a: a real replica; b, e: a replica that is alive but never takes a job (its queue stays full)
    return {name: f"harden-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b", "e")}


@pytest.fixture(scope="module")
def admin(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def replica(tiny_model, redis_url, tenants, admin, one_torch_thread):
    with ReplicaThread(
        tiny_model,
        redis_url,
        tenants["a"],
        consumer="harden-replica",
        served_model_name=MODEL,
        max_num_seqs=4,
        kv_cache_memory="64MiB",
    ) as running:
        wait_until(lambda: admin.exists(Keys(tenants["a"]).model_info(MODEL)), 60, "model info")
        yield running


class BusyReplica:
    """A replica of MODEL in each namespace that is alive but never takes a job: the real
    replica's model info copied there, and a consumer of the model's streams that only reads
    its own (empty) pending list every 0.3 s, which keeps it live for the gateway."""

    def __init__(self, admin: redis.Redis, source: str, namespaces: list[str]) -> None:
        self.admin, self.source, self.namespaces = admin, source, namespaces
        self.streams = [s for ns in namespaces for s in Keys(ns).all_model_requests(MODEL)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._touch, daemon=True)

    def __enter__(self) -> BusyReplica:
        info = self.admin.hgetall(Keys(self.source).model_info(MODEL))
        for ns in self.namespaces:
            keys = Keys(ns)
            self.admin.hset(keys.model_info(MODEL), mapping=info)
            self.admin.expire(keys.model_info(MODEL), 3600)
            self.admin.sadd(keys.models, MODEL)
        for stream in self.streams:
            self.admin.xgroup_create(stream, GROUP, id="0", mkstream=True)
        self.thread.start()
        return self

    def _touch(self) -> None:
        while not self.stop.is_set():
            self.admin.xreadgroup(GROUP, "busy-replica", {s: "0" for s in self.streams}, count=1)
            self.stop.wait(0.3)

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def busy(admin, tenants, replica):
    with BusyReplica(admin, tenants["a"], [tenants["b"], tenants["e"]]) as running:
        yield running


def env_of(**extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_GATEWAY_MAX_STORED_BYTES": str(STORED_LIMIT),
        "CONVEYOR_GATEWAY_MAX_TOTAL_TOKENS": str(MAX_TOTAL_TOKENS),
        "CONVEYOR_GATEWAY_MODEL_CACHE_S": "0.2",
        **extra,
    }


@pytest.fixture(scope="module")
def gateway(redis_url, tenants, busy, tmp_path_factory):
    keys = {f"key-{name}": ns for name, ns in tenants.items()}
    with GatewayProcess(redis_url, tmp_path_factory.mktemp("harden_gateway"), keys=keys, env=env_of()) as running:
        for name in tenants:
            wait_until(lambda name=name: MODEL in models(running, f"key-{name}"), 60, f"tenant {name}'s model")
        yield running


def models(gateway, key: str | None = None) -> list[str]:
    reply = httpx.get(f"{gateway.base_url}/models", headers=auth(key), timeout=30)
    return [m["id"] for m in reply.json()["data"]] if reply.status_code == 200 else []


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def create(gateway, key: str, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/responses", json={"model": MODEL, **body}, headers=auth(key), timeout=timeout
    )


def error_of(reply: httpx.Response) -> dict:
    return reply.json()["error"]


def stored_bytes(admin: redis.Redis, ns: str) -> dict[str, int]:
    """Each stored response record of `ns` and its size in Redis."""
    keys = admin.scan_iter(match=f"{ns}:response:resp_*", count=1000)
    return {key.decode().rsplit(":", 1)[1]: admin.strlen(key) for key in keys}


def job_status(admin: redis.Redis, ns: str, response_id: str) -> str | None:
    status = admin.hget(Keys(ns).job(response_id.removeprefix("resp_")), "status")
    return status and status.decode()


# ------------------------------------------------------------------ 5. stored responses


def test_one_tenants_stored_responses_are_bounded_and_the_rest_refused_naming_the_limit(gateway, admin, tenants):
    accepted, refused = [], []
    for _ in range(12):  # 12 x 200 kB of background input (on a queue that never moves)
        reply = create(gateway, "key-b", input="x" * BIG, background=True)
        assert reply.status_code in (200, 429), reply.text
        (accepted if reply.status_code == 200 else refused).append(reply)
    held = sum(stored_bytes(admin, tenants["b"]).values())
    print(f"\n12 background responses of {BIG} chars: {len(accepted)} stored, {held} bytes held")
    assert refused, f"all 12 stored ({held} bytes, over the limit of {STORED_LIMIT})"
    assert held <= STORED_LIMIT
    error = error_of(refused[0])
    assert error["code"] == "stored_bytes_full" and str(STORED_LIMIT) in error["message"], error
    assert "--max-stored-bytes" in error["message"]

    other = create(gateway, "key-a", input="hi", background=True, max_output_tokens=2)
    assert other.status_code == 200, f"tenant A is not held by B's bytes: {other.text}"

    euros = "\u20ac" * (STORED_LIMIT // 3 + 1000)  # 3 bytes each in UTF-8 (a job holds 1M characters at most)
    alone = create(gateway, "key-a", input=euros, background=True)
    assert alone.status_code == 413 and error_of(alone)["code"] == "stored_bytes_limit", alone.text
    assert str(STORED_LIMIT) in error_of(alone)["message"]

    deleted = httpx.delete(f"{gateway.base_url}/responses/{accepted[0].json()['id']}", headers=auth("key-b"))
    assert deleted.status_code == 200, deleted.text
    again = create(gateway, "key-b", input="x" * BIG, background=True)
    assert again.status_code == 200, f"a deleted response's bytes were freed: {again.text}"


def test_scribbled_accounting_keys_are_reset_not_fatal(gateway, admin, tenants):
    """The accounting keys lie in the tenant's namespace, which its producers may write: a key
    of the wrong type (WRONGTYPE in the script) resets the count instead of failing every
    stored response of the tenant from then on."""
    tag = f"{tenants['a']}:{{{tenants['a']}}}:stored"
    admin.delete(f"{tag}:sizes", f"{tag}:expiry", f"{tag}:bytes", f"{tag}:pending")
    admin.set(f"{tag}:sizes", "not a hash")
    admin.hset(f"{tag}:bytes", "not", "a string")
    admin.rpush(f"{tag}:pending", "resp_not-a-zset")
    reply = create(gateway, "key-a", input="hi", background=True, max_output_tokens=2)
    assert reply.status_code == 200, reply.text
    assert admin.type(f"{tag}:sizes") == b"hash" and admin.type(f"{tag}:bytes") == b"string"
    assert admin.type(f"{tag}:pending") in (b"zset", b"none")
    counted = int(admin.hget(f"{tag}:sizes", reply.json()["id"]))
    assert int(admin.get(f"{tag}:bytes")) == counted > 0, "the count starts again from this response"


SHORT_TTL_S = 12  # far longer than 8 requests take (well under a second), even on a loaded box


def test_expired_responses_leave_the_count(redis_url, tenants, busy, tmp_path_factory):
    with GatewayProcess(
        redis_url,
        tmp_path_factory.mktemp("harden_ttl"),
        keys={"key-e": tenants["e"]},
        args=["--result-ttl", str(SHORT_TTL_S)],
        env=env_of(),
    ) as short:
        wait_until(lambda: MODEL in models(short, "key-e"), 60, "tenant e's model")
        started = time.monotonic()
        statuses = [create(short, "key-e", input="x" * BIG, background=True).status_code for _ in range(8)]
        took = time.monotonic() - started  # records expire SHORT_TTL_S after their own admission
        assert 429 in statuses, f"{statuses} ({took:.1f} s for 8 requests: none may expire before the last)"
        time.sleep(max(0.0, started + SHORT_TTL_S + 1 - time.monotonic()))  # every record expired
        assert create(short, "key-e", input="x" * BIG, background=True).status_code == 200


def wait_failed(admin, ns: str, response_ids: list[str], timeout: float = 60) -> None:
    wait_until(
        lambda: all(job_status(admin, ns, r) == "error" for r in response_ids), timeout, "the jobs to fail (too long)"
    )


def test_a_background_response_whose_job_failed_keeps_no_input(gateway, admin, tenants):
    reply = create(gateway, "key-a", input="y" * 100_000, background=True)  # far over the model's 1024 tokens
    assert reply.status_code == 200, reply.text
    response_id = reply.json()["id"]
    assert stored_bytes(admin, tenants["a"])[response_id] > 100_000
    wait_failed(admin, tenants["a"], [response_id])
    polled = httpx.get(f"{gateway.base_url}/responses/{response_id}", headers=auth("key-a"), timeout=30).json()
    assert polled["status"] == "failed", polled
    size = stored_bytes(admin, tenants["a"])[response_id]
    print(f"\nfailed background response: {size} bytes stored")
    assert size < 10_000, f"the failed response still stores {size} bytes (its input)"


def test_a_full_tenant_settles_its_failed_background_responses(gateway, admin, tenants):
    ids = []
    for _ in range(3):  # 3 x 300 kB: the limit nearly full, with jobs that fail
        reply = create(gateway, "key-a", input="z" * 300_000, background=True)
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    wait_failed(admin, tenants["a"], ids)  # nobody polls them
    time.sleep(1.1)
    reply = create(gateway, "key-a", input="z" * 300_000, background=True)
    assert reply.status_code == 200, reply.text
    sizes = stored_bytes(admin, tenants["a"])
    assert all(sizes.get(i, 0) < 10_000 for i in ids), {i: sizes.get(i) for i in ids}
    assert sum(sizes.values()) <= STORED_LIMIT


def test_compose_redis_has_a_memory_bound_that_never_evicts():
    compose = yaml.safe_load((REPO_ROOT / "compose" / "docker-compose.yml").read_text())
    script = compose["services"]["redis"]["command"][2]
    assert re.search(r"--maxmemory \d+[kmg]b\b", script), script
    assert re.search(r"--maxmemory-policy noeviction\b", script), script
    text = (REPO_ROOT / "compose" / "docker-compose.yml").read_text()
    assert "never evicts" in text, "the comment saying why noeviction"
    gateway_env = compose["services"]["gateway"]["environment"]
    assert "gateway" in gateway_env["CONVEYOR_GATEWAY_ALLOWED_HOSTS"].split(","), "Prometheus scrapes gateway:8000"


# ------------------------------------------------------------------ 8. work caps of /v1/responses


def test_responses_get_the_work_caps_of_chat_completions(gateway):
    sdk = openai_client(gateway, api_key="key-a")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=MODEL, input="hi", max_output_tokens=MAX_TOTAL_TOKENS + 1)
    error = refused.value.body
    assert error["param"] == "max_output_tokens" and f"limit of {MAX_TOTAL_TOKENS}" in error["message"], error

    plain = sdk.responses.create(model=MODEL, input="hi", extra_body={"ignore_eos": True})
    assert plain.usage.output_tokens <= MAX_TOTAL_TOKENS, plain.usage

    queued = sdk.responses.create(model=MODEL, input="hi", background=True, extra_body={"ignore_eos": True})
    done = wait_until(
        lambda: (r := sdk.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
        120,
        "the background response",
        interval=0.3,
    )
    print(f"\nbackground response without max_output_tokens: {done.usage.output_tokens} tokens")
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= MAX_TOTAL_TOKENS, done


# ------------------------------------------------------------------ 7. DNS rebinding


@pytest.fixture(scope="module")
def open_gateway(redis_url, tmp_path_factory):
    """No API keys (the default, on loopback): only the Host header tells a rebound page."""
    with GatewayProcess(
        redis_url, tmp_path_factory.mktemp("harden_open"), namespace=f"open-{uuid.uuid4().hex[:8]}"
    ) as g:
        yield g


def with_host(gateway, host: str, method: str = "GET", path: str = "/v1/models", **options) -> httpx.Response:
    return httpx.request(
        method, f"{gateway.url}{path}", headers={"Host": host, **options.pop("headers", {})}, **options
    )


def test_a_foreign_host_header_is_refused(open_gateway):
    port = open_gateway.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", f"LOCALHOST:{port}"):
        assert with_host(open_gateway, host).status_code == 200, host
    for host in (f"attacker.example:{port}", "attacker.example", f"localhost.attacker.example:{port}"):
        for method, path, extra in (
            ("GET", "/v1/models", {}),
            ("GET", "/dashboard/api/overview", {}),
            ("POST", "/dashboard/api/dead/requeue", {"headers": {"X-Conveyor-Dashboard": "1"}, "json": {}}),
        ):
            reply = with_host(open_gateway, host, method, path, **extra)
            assert reply.status_code == 400, (host, path, reply.status_code, reply.text)
            error = error_of(reply)
            assert error["code"] == "invalid_host" and error["param"] == "Host", error
            assert "Host header" in error["message"] and "--allowed-hosts" in error["message"]


@pytest.mark.parametrize(("allowed", "host", "status"), [("api.example,*.corp.example", "a.b.corp.example", 200)])
def test_allowed_hosts_are_answered(redis_url, tmp_path_factory, allowed, host, status):
    env = {"CONVEYOR_GATEWAY_ALLOWED_HOSTS": allowed}
    with GatewayProcess(redis_url, tmp_path_factory.mktemp("harden_allowed"), env=env) as allowing:
        assert with_host(allowing, f"api.example:{allowing.port}").status_code == 200
        assert with_host(allowing, host).status_code == status
        assert with_host(allowing, "corp.example").status_code == 400
        assert with_host(allowing, "other.example").status_code == 400
    env = {"CONVEYOR_GATEWAY_ALLOWED_HOSTS": "*"}
    with GatewayProcess(redis_url, tmp_path_factory.mktemp("harden_any"), env=env) as any_host:
        assert with_host(any_host, "anything.example").status_code == 200


def test_a_malformed_allowed_hosts_entry_is_refused_at_start(redis_url, tmp_path_factory):
    env = {"CONVEYOR_GATEWAY_ALLOWED_HOSTS": "good.example,bad*.example"}
    gateway = GatewayProcess(redis_url, tmp_path_factory.mktemp("harden_bad"), env=env).start()
    try:
        assert gateway.process.wait(30) == 2
    finally:
        gateway.stop()
    assert "allowed_hosts" in gateway.log_text()


# ------------------------------------------------------------------ 6. idle connections of one address


class Flood:
    """`count` sockets from `source` that never send a byte, each reopened (after `pause_s`)
    as soon as the gateway closes it, for at most `limit_s`."""

    def __init__(self, port: int, count: int, source: str = "127.0.0.1", pause_s: float = 0.005, limit_s=30.0):
        self.port, self.count, self.source, self.pause_s = port, count, source, pause_s
        self.ends = time.monotonic() + limit_s
        self.opened = self.refused = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        held = selectors.DefaultSelector()  # epoll: past 1024 descriptors too
        try:
            while not self.stop.is_set() and time.monotonic() < self.ends:
                while len(held.get_map()) < self.count:
                    sock = socket.create_connection(("127.0.0.1", self.port), 5, (self.source, 0))
                    held.register(sock, selectors.EVENT_READ)
                    self.opened += 1
                for key, _ in held.select(0.05):
                    try:
                        data = key.fileobj.recv(4096)
                    except OSError:
                        data = b""
                    self.refused += data.startswith(b"HTTP/1.1 503")
                    held.unregister(key.fileobj)
                    key.fileobj.close()
                time.sleep(self.pause_s)
        finally:
            for key in list(held.get_map().values()):
                key.fileobj.close()
            held.close()


def legit(gateway, key: str | None, source: str) -> int:
    """One request on a connection of its own from `source`: its status (503 when refused)."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as client:
            return client.get(f"{gateway.url}/v1/models", headers=auth(key)).status_code
    except httpx.TransportError:  # closed without a response
        return 0


@pytest.fixture(scope="module", params=["keyed", "no keys"])
def small_gateway(request, redis_url, tmp_path_factory):
    """At most MAX_CONNECTIONS connections (so 3/4 of them per address), headers within 2 s: the
    attack's sockets are closed and come back."""
    keys = {"key-c": f"conn-{uuid.uuid4().hex[:8]}"} if request.param == "keyed" else None
    args = ["--max-connections", str(MAX_CONNECTIONS), "--header-timeout-s", "2"]
    with GatewayProcess(redis_url, tmp_path_factory.mktemp("harden_conn"), keys=keys, args=args) as g:
        g.key = "key-c" if keys else None
        yield g


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"])
def test_idle_sockets_of_one_address_never_keep_keyed_requests_out(small_gateway, source):
    with Flood(small_gateway.port, count=MAX_CONNECTIONS + 50) as flood:
        wait_until(lambda: flood.refused >= 50, 20, "the flood to reach the cap")
        time.sleep(0.5)
        statuses = [legit(small_gateway, small_gateway.key, source) for _ in range(21)]
    ok = statuses.count(200)
    print(f"\n{flood.opened} idle sockets opened from 127.0.0.1 ({flood.refused} refused): {ok}/21 from {source} ok")
    assert ok == 21, statuses
    assert flood.refused >= 50, "the flood was held to its share"


def test_the_stored_responses_error_is_json():  # the 429 body is what the SDK shows
    from conveyor.gateway.response_store import StoreFull

    full, alone = StoreFull(10, 95, 100), StoreFull(101, 0, 100)
    assert (full.status, alone.status) == (429, 413)
    assert json.loads(json.dumps(full.body()))["error"]["code"] == "stored_bytes_full"


def test_peers_and_host_names():
    from conveyor.gateway.allowed_hosts import HostPolicy, hostname
    from conveyor.gateway.connection_limits import peer_of

    assert peer_of(("127.0.0.2", 5)) == "127.0.0.2"
    assert peer_of(("::ffff:10.0.0.1", 5)) == "10.0.0.1"
    assert peer_of(("2001:db8:1:2:3:4:5:6", 5)) == peer_of(("2001:db8:1:2:ffff::1", 9)) == "2001:db8:1:2::/64"
    assert hostname("[::1]:8000") == "::1" and hostname("Example.COM.:80") == "example.com"
    policy = HostPolicy("", "gw.internal")
    assert policy.allows("gw.internal:8000") and policy.allows("10.1.2.3:8000") and policy.allows("localhost")
    assert not policy.allows("evil.example") and not policy.allows("localhost.evil.example")
    assert HostPolicy("", "0.0.0.0").names == {"localhost"}
    with pytest.raises(ValueError):
        HostPolicy("a b.example", "")
