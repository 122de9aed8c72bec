"""The operator's dashboard and the queue's gauges, against a real gateway, Valkey and replica.

- A real headless browser (Debian's chromium, driven by playwright) opens /dashboard with an
  admin key: it shows the queued count, then the replica and the count falling as the jobs
  finish, lists the replica's real dead letter and requeues it (the job then completes);
  HTML planted as a job id, a reason, a stream, a model and a replica name shows as text and
  never runs, and a 1 MB reason reaches the page cut to 200 characters.
- Keys: a tenant key sees only its namespace, read-only; actions need the admin key and the
  dashboard's header.
- /metrics: the documented gauge names and values, and a scrape with 100,000 queued jobs
  costs as many Redis commands as one with a single queued job (but for the deadline scan's
  at most 3 more pages), at most MAX_SCRAPE_COMMANDS
  (counted with the gateway connections' tot-cmds in CLIENT LIST, which counts the
  commands scripts run too).
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx
import pytest
import redis
from fault_harness import wait_until
from gateway_harness import GatewayProcess, GatewayThread
from prometheus_client.parser import text_string_to_metric_families
from replica_harness import ReplicaThread
from scratch import scratch_namespace

from conveyor.clients import Client
from conveyor.clients.keys import Keys
from conveyor.clients.queue_metrics import DEADLINE_SCAN_ENTRIES, DEADLINE_SCAN_PAGE

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "tiny"
ADMIN_KEY, TENANT_KEY = "sk-dash-admin-0123", "sk-dash-tenant-4567"
MAX_SCRAPE_COMMANDS = 30  # one namespace, one partition, one model, nothing else (docs/dashboard.md)
GAUGES = (
    "conveyor_queue_length",
    "conveyor_queue_pending",
    "conveyor_queue_lag",
    "conveyor_queue_oldest_age_seconds",
    "conveyor_queue_consumers",
    "conveyor_dead_letters",
    "conveyor_replicas_live",
)
# planted payloads: each would set window.__pwned if the page ever ran it as HTML
XSS = {
    "job": "<img src=x onerror=\"window.__pwned='job'\">",
    "reason": "<img src=x onerror=\"window.__pwned='reason'\">",
    "stream": "<script>window.__pwned='stream'</script>",
    "model": "<img src=x onerror=\"window.__pwned='model'\">",
    "replica": "<svg onload=\"window.__pwned='replica'\"></svg>",
}


@pytest.fixture(scope="module")
def ns(redis_url):
    with scratch_namespace(redis_url, "dash") as namespace:
        yield namespace


@pytest.fixture(scope="module")
def tenant_ns(redis_url):
    with scratch_namespace(redis_url, "dash-tenant") as namespace:
        yield namespace


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory, ns, tenant_ns):
    path = tmp_path_factory.mktemp("dash_keys") / "keys.json"
    path.write_text(json.dumps({ADMIN_KEY: {"namespace": ns, "admin": True}, TENANT_KEY: {"namespace": tenant_ns}}))
    return path


@pytest.fixture(scope="module")
def raw(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- /metrics

FILL_LUA = """
for i = 1, tonumber(ARGV[1]) do
  redis.call('XADD', KEYS[1], '*', 'json', '{"job_id":"bulk-' .. i .. '","prompt":"x","max_tokens":1}')
end
return 1
"""


def named_url(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query=urlencode({"client_name": name})))


def commands_of(raw, name: str) -> int:
    """Commands run so far by the connections named `name` (scripts' own commands included)."""
    return sum(int(c["tot-cmds"]) for c in raw.client_list() if c.get("name") == name)


def scrape(gateway) -> dict[str, dict[tuple, float]]:
    time.sleep(1.05)  # past the gateway's reuse of a read (QueueWatch MAX_AGE_S)
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_queue_gauges_cost_the_same_redis_commands_with_100k_jobs_queued(redis_url, raw):
    with scratch_namespace(redis_url, "dash-scrape") as scrape_ns:
        keys, name = Keys(scrape_ns), f"dash-scrape-{uuid.uuid4().hex[:8]}"
        stream = keys.model_requests(MODEL, "interactive")
        raw.sadd(keys.models, MODEL)
        raw.xgroup_create(stream, "engines", id="0", mkstream=True)
        raw.eval(FILL_LUA, 1, stream, 11)
        raw.xreadgroup("engines", "probe", {stream: ">"}, count=10)  # 10 in flight, 1 waiting
        with GatewayThread(named_url(redis_url, name), scrape_ns) as gateway:
            scrape(gateway)  # the connections and the scripts' first load
            before = commands_of(raw, name)
            one_waiting = scrape(gateway)
            small = commands_of(raw, name) - before
            started = time.perf_counter()
            raw.eval(FILL_LUA, 1, stream, 100_000)
            filled_s = time.perf_counter() - started
            before = commands_of(raw, name)
            full = scrape(gateway)
            large = commands_of(raw, name) - before
        print(f"\nRedis commands per scrape: {small} (1 waiting), {large} (100,001 waiting); fill {filled_s:.2f} s")
        # the same, but for the deadline gauge's scan of the oldest waiting entries, a page at a time
        assert small <= large <= small + DEADLINE_SCAN_ENTRIES // DEADLINE_SCAN_PAGE - 1
        assert large <= MAX_SCRAPE_COMMANDS
        assert set(GAUGES) <= set(full), sorted(set(GAUGES) - set(full))
        labels = (("model", MODEL), ("namespace", scrape_ns), ("partition", "0"), ("priority_class", "interactive"))
        assert one_waiting["conveyor_queue_lag"][labels] == 1
        assert full["conveyor_queue_length"][labels] == 100_011
        assert full["conveyor_queue_pending"][labels] == 10
        assert full["conveyor_queue_lag"][labels] == 100_001
        assert full["conveyor_queue_consumers"][labels] == 1
        assert 0 <= full["conveyor_queue_oldest_age_seconds"][labels] < 120
        assert full["conveyor_dead_letters"][(("namespace", scrape_ns),)] == 0


# ---------------------------------------------------------------- keys


def test_a_tenant_key_sees_only_its_namespace_and_cannot_act(redis_url, keys_file, ns, tenant_ns):
    with GatewayThread(redis_url, keys_file=keys_file) as gateway:
        api = f"{gateway.url}/dashboard/api"
        assert httpx.get(f"{api}/overview").status_code == 401
        assert httpx.get(f"{gateway.url}/dashboard").status_code == 200  # the page holds no data
        tenant = httpx.get(f"{api}/overview", headers=auth(TENANT_KEY)).json()
        assert (tenant["namespace"], tenant["namespaces"], tenant["may_act"]) == (tenant_ns, [tenant_ns], False)
        assert httpx.get(f"{api}/overview", params={"ns": ns}, headers=auth(TENANT_KEY)).status_code == 403
        action = {**auth(TENANT_KEY), "X-Conveyor-Dashboard": "1"}
        assert httpx.post(f"{api}/dead/requeue", json={"all": True}, headers=action).status_code == 403
        admin = httpx.get(f"{api}/overview", params={"ns": tenant_ns}, headers=auth(ADMIN_KEY)).json()
        assert (admin["namespace"], admin["namespaces"], admin["may_act"]) == (tenant_ns, sorted([ns, tenant_ns]), True)
        no_header = httpx.post(f"{api}/dead/requeue", json={"all": True}, headers=auth(ADMIN_KEY))
        assert no_header.status_code == 403  # another site's form could not add the header
        assert httpx.get(f"{api}/job/{'x' * 300}", headers=auth(ADMIN_KEY)).status_code == 404


def test_conveyor_dashboard_serves_the_page_without_the_api(redis_url, tmp_path):
    program = (sys.executable, "-m", "conveyor.gateway.dashboard")
    with GatewayProcess(redis_url, tmp_path, "dash-alone", entry=program) as dashboard:
        assert httpx.get(f"{dashboard.url}/dashboard").status_code == 200
        assert httpx.get(f"{dashboard.url}/dashboard/api/overview").json()["namespace"] == "dash-alone"
        assert httpx.get(f"{dashboard.url}/v1/models").status_code == 404


# ---------------------------------------------------------------- the page in a browser


def plant_hostile_records(raw, keys: Keys) -> None:
    """What any writer of the namespace could put where the dashboard reads."""
    raw.sadd(keys.models, XSS["model"])
    raw.xadd(keys.model_requests(XSS["model"], "interactive"), {"json": "{}"})  # nobody serves it: stays queued
    letter = {"stream": XSS["stream"], "entry_id": "1-0", "at": "1700000000", "job_id": XSS["job"], "truncated": "1"}
    raw.xadd(keys.dead, {**letter, "reason": XSS["reason"] + "A" * 1_000_000})
    raw.hset(keys.replica(XSS["replica"]), mapping={"model": XSS["model"], "state": "serving", "running": "1"})
    raw.zadd(keys.replicas, {XSS["replica"]: time.time() + 3600})  # stays "live" through the test


def park_a_job(raw, keys: Keys, job_id: str) -> None:
    """A valid job that three replicas are said to have died running: the next delivery
    is past --max-deliveries 3, so the replica dead-letters it with its payload kept."""
    raw.hset(keys.job(job_id), mapping={"attempt": 3, "status": "queued"})
    raw.expire(keys.job(job_id), 600)
    job = {"job_id": job_id, "prompt": "def f():", "max_tokens": 4, "temperature": 0, "model": MODEL}
    raw.xadd(keys.model_requests(MODEL, "interactive"), {"json": json.dumps(job)})


def test_the_page_follows_the_queue_requeues_a_dead_letter_and_never_runs_planted_html(
    browser, raw, redis_url, ns, keys_file, tiny_model, one_torch_thread
):
    from playwright.sync_api import expect

    keys = Keys(ns)
    plant_hostile_records(raw, keys)
    client = Client(redis_url, namespace=ns)
    with GatewayThread(redis_url, keys_file=keys_file) as gateway:
        page = browser.new_page()
        page.goto(f"{gateway.url}/dashboard")
        page.fill("#key", ADMIN_KEY)
        page.click("#key-form button")
        # no model named: the default stream, which every replica reads (a model's own stream
        # is counted once a replica of it published the model: docs/dashboard.md)
        jobs = [client.submit(prompt=f"def f{i}():", max_tokens=8, temperature=0) for i in range(6)]
        expect(page.locator("#queued-total")).to_have_text("7", timeout=10_000)  # 6 + the planted one
        expect(page.locator("#queues tr", has_text="(any model)")).to_contain_text("6")
        with ReplicaThread(
            tiny_model,
            redis_url,
            ns,
            consumer="dash-replica",
            served_model_name=MODEL,
            max_num_seqs=4,
            kv_cache_memory="64MiB",
        ):
            for job in jobs:
                assert job.result(timeout=60).token_ids
            # the default stream appeared after the page's first samples: its rate still counts
            overview = lambda: httpx.get(f"{gateway.url}/dashboard/api/overview", headers=auth(ADMIN_KEY)).json()  # noqa: E731
            wait_until(lambda: any(q["done_per_s"] > 0 for q in overview()["queues"]), 15, "a done/s above 0")
            assert max(overview()["throughput"]["done_per_s"]) > 0
            expect(page.locator("#chart polyline.done")).to_have_attribute("points", re.compile(r"\d"), timeout=10_000)
            expect(page.locator("#replicas")).to_contain_text("dash-replica", timeout=10_000)
            [today] = [t for t in overview()["tenants_today"] if t["namespace"] == ns]
            assert today["model"] == MODEL and today["jobs"] == 6 and today["completion_tokens"] == 48
            expect(page.locator("#tenants tr", has_text=ns)).to_contain_text("48", timeout=10_000)
            expect(page.locator("#replicas tr", has_text="dash-replica")).to_contain_text("serving")
            expect(page.locator("#queued-total")).to_have_text("1", timeout=10_000)
            park_a_job(raw, keys, "unlucky")
            parked = page.locator("#dead tr", has_text="unlucky")
            expect(parked).to_contain_text("max_deliveries", timeout=15_000)
            parked.locator("button").click()
            expect(page.locator("#dead-note")).to_contain_text("requeued 1", timeout=10_000)
            wait_until(lambda: raw.hget(keys.job("unlucky"), "status") == b"done", 60, "the requeued job to finish")
            assert client.job("unlucky").result(timeout=5).token_ids
            expect(page.locator("#dead")).not_to_contain_text("unlucky", timeout=10_000)
        expect(page.locator("#replicas tr", has_text="dash-replica")).to_contain_text("gone", timeout=10_000)
        for where, payload in (("#dead", XSS["job"]), ("#dead", XSS["stream"]), ("#queues", XSS["model"])):
            expect(page.locator(where)).to_contain_text(payload)  # as text
        expect(page.locator("#replicas")).to_contain_text(XSS["replica"])
        reason = page.locator("#dead tr", has_text="onerror=\"window.__pwned='reason'").locator("td").nth(4)
        assert len(reason.text_content()) <= 200
        assert page.locator("tbody img, tbody script, tbody svg").count() == 0
        assert page.evaluate("window.__pwned") is None
        page.close()
