"""The dashboard follows a job: its page, the lists of jobs by state, the "waiting" count.

- In a real browser (Debian's chromium, driven by playwright) against a real gateway, Valkey
  and replica: a finished job's page shows its status, its prompt (planted HTML shown as text,
  cut to 500 characters), its result, timings, its attempt with the replica and the trace id;
  the "done" list pages through 56 jobs, 50 to a page, each once; with one sequence slot and
  three long jobs the cards say 1 queued, 1 waiting, 1 running; Cancel on a running job's
  page ends it cancelled.
- Through httpx, the JSON routes' answers to hostile input: a bad job id (400 naming it), an
  unknown one (404 naming it), junk in every job hash field (the page still answers, values
  coerced and bounded), a key of another type, cursors this list did not make, a huge cursor;
  Retry requeues a parked job's dead letter as `conveyor dead requeue` does; webhook dead
  letters page newest first; a tenant key reads only its namespace and cannot act.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
from fault_harness import wait_until
from gateway_harness import GatewayThread
from model_factory import build_tiny_model
from replica_harness import ReplicaThread
from scratch import scratch_namespace

from conveyor.clients import Client
from conveyor.clients.errors import JobCancelled
from conveyor.clients.events import ErrorEvent, encode_event_data
from conveyor.clients.keys import Keys
from conveyor.clients.webhook_queue import new_event

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
ADMIN_KEY, TENANT_KEY = "sk-jobs-admin-0123", "sk-jobs-tenant-4567"
CONSUMER = "jobs-replica"
XSS_PROMPT = "<img src=x onerror=\"window.__pwned='prompt'\">" + "A" * 2000
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
DONE_JOBS = 55  # + the planted one: more than one page of 50
BLOCKER = 4000  # tokens: outlasts the test's waits on a fast CPU (cancelled after)


@pytest.fixture(scope="module")
def raw(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama with room for BLOCKER-token jobs."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("jobs_llama"), max_position_embeddings=4096)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def act_headers(key: str) -> dict[str, str]:
    return {**auth(key), "X-Conveyor-Dashboard": "1"}


# ---------------------------------------------------------------- the browser


def test_the_page_follows_a_job_lists_jobs_by_state_and_cancels_a_running_one(
    redis_url, raw, long_model, one_torch_thread
):
    from playwright.sync_api import expect, sync_playwright

    with scratch_namespace(redis_url, "dash-jobs") as ns, sync_playwright() as driver:
        keys, client = Keys(ns), Client(redis_url, namespace=ns)
        planted = client.submit(prompt=XSS_PROMPT, max_tokens=8, temperature=0, traceparent=TRACEPARENT)
        done = [client.submit(prompt_token_ids=[5, 6, i], max_tokens=2, temperature=0) for i in range(DONE_JOBS)]
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        replica = ReplicaThread(long_model, redis_url, ns, consumer=CONSUMER, max_num_seqs=1, num_kv_blocks=256)
        with GatewayThread(redis_url, ns) as gateway, replica:
            result = planted.result(timeout=60)
            for job in done:
                job.result(timeout=60)
            started = raw.hget(keys.job(planted.job_id), "started:1")  # START_LUA wrote it
            page = browser.new_page()
            page.goto(f"{gateway.url}/dashboard#job/{planted.job_id}")

            # one job's page: planted HTML in its prompt shows as text, cut
            expect(page.locator("#job-facts")).to_contain_text("done", timeout=10_000)
            expect(page.locator("#job-prompt")).to_contain_text("<img src=x onerror=")
            assert len(page.locator("#job-prompt").text_content()) <= 500
            expect(page.locator("#job-output")).to_have_text(result.text)
            expect(page.locator("#job-facts")).to_contain_text("ttft")
            expect(page.locator("#job-facts")).to_contain_text(f"completion {result.usage.completion_tokens}")
            attempt = page.locator("#job-attempts tr").first
            expect(attempt).to_contain_text(CONSUMER)
            expect(attempt).to_contain_text(TRACE_ID)  # the producer's traceparent: the first attempt's trace
            assert started is not None
            assert page.locator("#job-view img").count() == 0
            assert page.evaluate("window.__pwned") is None
            expect(page.locator("#job-cancel")).to_be_hidden()  # a finished job

            # the "done" list, 50 to a page, each job once, rows linking to their pages
            page.click("#job-back")
            page.click("#job-tabs button[data-state=done]")
            expect(page.locator("#job-list tr")).to_have_count(50, timeout=10_000)
            listed = page.locator("#job-list a").all_text_contents()
            page.click("#jobs-next")
            expect(page.locator("#job-list tr")).to_have_count(DONE_JOBS + 1 - 50, timeout=10_000)
            listed += page.locator("#job-list a").all_text_contents()
            assert sorted(listed) == sorted([planted.job_id, *(j.job_id for j in done)])
            expect(page.locator("#jobs-next")).to_be_disabled()

            # one sequence slot, two in flight (2 x max_num_seqs), the third queued
            blockers = [
                client.submit(prompt_token_ids=[7, 8, i], max_tokens=BLOCKER, ignore_eos=True, temperature=0)
                for i in range(3)
            ]
            for card, count in (("#queued-total", "1"), ("#waiting-total", "1"), ("#running-total", "1")):
                expect(page.locator(card)).to_have_text(count, timeout=15_000)
            first = blockers[0].job_id
            page.click("#job-tabs button[data-state=running]")
            expect(page.locator("#job-list")).to_contain_text(first, timeout=10_000)
            page.click(f"#job-list a:text-is('{first}')")
            expect(page.locator("#job-facts")).to_contain_text("running", timeout=10_000)
            page.click("#job-cancel")
            expect(page.locator("#job-facts")).to_contain_text("cancelled", timeout=20_000)
            with pytest.raises(JobCancelled):
                blockers[0].result(timeout=10)
            for job in blockers[1:]:
                job.cancel()
            for job in blockers[1:]:
                with pytest.raises(JobCancelled):
                    job.result(timeout=30)
            page.close()
        browser.close()
        client.close()


# ---------------------------------------------------------------- the JSON routes


@pytest.fixture(scope="module")
def namespaces(redis_url):
    with scratch_namespace(redis_url, "dash-jobs-a") as admin_ns, scratch_namespace(redis_url, "dash-jobs-t") as tenant:
        yield admin_ns, tenant


@pytest.fixture(scope="module")
def gateway(redis_url, namespaces, tmp_path_factory):
    admin_ns, tenant_ns = namespaces
    path = tmp_path_factory.mktemp("jobs_keys") / "keys.json"
    path.write_text(
        json.dumps({ADMIN_KEY: {"namespace": admin_ns, "admin": True}, TENANT_KEY: {"namespace": tenant_ns}})
    )
    with GatewayThread(redis_url, keys_file=path) as running:
        yield running


def api(gateway, path: str, key: str = ADMIN_KEY, **params) -> httpx.Response:
    return httpx.get(f"{gateway.url}/dashboard/api{path}", params=params, headers=auth(key), timeout=10)


def test_a_bad_or_unknown_job_id_is_named_in_the_answer(gateway):
    bad = api(gateway, "/jobs/no spaces!")
    assert bad.status_code == 400 and "no spaces!" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "job_id"
    assert api(gateway, "/jobs/" + "x" * 300).status_code == 400
    unknown = api(gateway, "/jobs/never-submitted")
    assert unknown.status_code == 404 and "never-submitted" in unknown.json()["error"]["message"]


def test_junk_in_every_job_hash_field_is_coerced_and_bounded(gateway, raw, namespaces):
    keys = Keys(namespaces[0])
    raw.hset(
        keys.job("junk"),
        mapping={
            "status": "running",
            "attempt": "99999999",
            "updated": "nan",
            "cancel": "yes",
            "entry": "<b>not an id</b>",
            "prompt_head": "P" * 100_000,
            "started:99999999": "1700000000",  # never read: past the 32 attempts recorded
            "started:32": "1e400",
            "replica:32": "<svg onload=alert(1)>" * 1000,
            "trace:32": "NOT-HEX-" * 8,
            "trace:31": "ab" * 16,
            "started:31": "1700000000.5",
        },
    )
    job = api(gateway, "/jobs/junk").json()
    assert (job["status"], job["attempt"], job["updated"], job["cancel_requested"]) == (
        "running",
        99999999,
        None,
        False,
    )
    assert len(job["prompt"]) == 500 and job["entry"] == ""
    assert len(job["attempts"]) == 32 and job["attempts"][-1]["attempt"] == 32
    last, before = job["attempts"][-1], job["attempts"][-2]
    assert last["started"] is None and last["trace_id"] == "" and len(last["replica"]) <= 200
    assert (before["started"], before["trace_id"]) == (1700000000.5, "ab" * 16)
    raw.hset(keys.job("junk-done"), mapping={"status": "done", "attempt": "-5", "result": b"\xc1\xff not msgpack"})
    job = api(gateway, "/jobs/junk-done").json()
    assert job["attempts"] == [] and job["error"] == "(the stored result is unreadable)"
    raw.set(keys.job("a-string"), "not a hash")
    job = api(gateway, "/jobs/a-string").json()
    assert job["status"] == "unreadable" and "string" in job["error"]


def test_a_queued_job_shows_the_prompt_of_its_request_entry(gateway, redis_url, namespaces):
    with Client(redis_url, namespace=namespaces[0]) as client:
        queued = client.submit(messages=[{"role": "user", "content": "<b>hello</b> " * 100}], max_tokens=2)
        by_ids = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
    job = api(gateway, f"/jobs/{queued.job_id}").json()
    assert job["status"] == "queued" and job["prompt_source"] == "request entry"
    assert job["prompt"].startswith("<b>hello</b> ") and len(job["prompt"]) == 500
    assert job["cancellable"] and not job["attempts"]
    assert api(gateway, f"/jobs/{by_ids.job_id}").json()["prompt"] == "<3 prompt token ids>"


def test_list_cursors_are_checked_and_pages_are_bounded(gateway, redis_url, namespaces):
    with Client(redis_url, namespace=namespaces[0]) as client:
        for i in range(3):
            client.submit(prompt=f"queued {i}", max_tokens=1)
    first = api(gateway, "/jobs", state="queued").json()
    assert len(first["jobs"]) >= 3 and all(j["status"] == "queued" for j in first["jobs"])
    for cursor in ("0.99999999999999999999.0", "0.18446744073709551616.0", "abc", "1.2", "-1.0.0", "0.0.0" + "0" * 50):
        answer = api(gateway, "/jobs", state="queued", cursor=cursor)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "cursor", cursor
    assert api(gateway, "/jobs", state="queued", cursor="7.0.0").json() == {"state": "queued", "jobs": [], "next": None}
    assert api(gateway, "/jobs", state="<script>").status_code == 400
    assert api(gateway, "/webhooks/dead", before="junk").status_code == 400


def test_retry_requeues_a_parked_jobs_dead_letter(gateway, raw, namespaces):
    keys = Keys(namespaces[0])
    parked = ErrorEvent(attempt=4, code="max_deliveries", message="delivered 4 times (max_deliveries=3)")
    raw.hset(keys.job("parked"), mapping={"status": "error", "attempt": "4", "result": encode_event_data(parked)})
    payload = json.dumps({"job_id": "parked", "prompt": "hi", "max_tokens": 1})
    letter = {"stream": keys.interactive, "entry_id": "1-0", "reason": "max_deliveries", "at": "1700000000"}
    dead_id = raw.xadd(keys.dead, {**letter, "job_id": "parked", "field:json": payload}).decode()
    job = api(gateway, "/jobs/parked").json()
    assert job["retryable"] and job["dead_letters"][0]["dead_id"] == dead_id
    assert job["error"].startswith("max_deliveries")
    url = f"{gateway.url}/dashboard/api/jobs/parked/retry"
    assert httpx.post(url, headers=auth(ADMIN_KEY)).status_code == 403  # no dashboard header
    answer = httpx.post(url, headers=act_headers(ADMIN_KEY))
    assert answer.status_code == 200 and answer.json()["requeued"] == dead_id
    assert raw.hget(keys.job("parked"), "status") == b"queued" and raw.xlen(keys.dead) == 0
    [(_, fields)] = raw.xrange(keys.interactive, min=answer.json()["entry"], max=answer.json()["entry"])
    assert json.loads(fields[b"json"])["job_id"] == "parked"
    again = httpx.post(url, headers=act_headers(ADMIN_KEY))
    assert again.status_code == 409 and "parked" in again.json()["error"]["message"]
    cancel = httpx.post(f"{gateway.url}/dashboard/api/jobs/never-submitted/cancel", headers=act_headers(ADMIN_KEY))
    assert cancel.status_code == 409


def test_webhook_dead_letters_page_newest_first(gateway, raw, namespaces):
    keys = Keys(namespaces[0])
    for i in range(52):
        event = new_event("job.failed" if i % 2 else "batch.completed", f"job-{i}")
        raw.xadd(keys.webhooks_dead, {**event, "reason": f"<b>HTTP 500</b> #{i}"})
    first = api(gateway, "/webhooks/dead").json()
    assert len(first["letters"]) == 50 and first["total"] == 52
    newest = first["letters"][0]
    assert (newest["data_id"], newest["job_id"], newest["type"]) == ("job-51", "job-51", "job.failed")
    assert "HTTP 500" in newest["detail"] and first["letters"][1]["job_id"] == ""  # a batch's event: no job
    rest = api(gateway, "/webhooks/dead", before=first["next"]).json()
    assert [w["data_id"] for w in rest["letters"]] == ["job-1", "job-0"] and rest["next"] is None


def test_a_tenant_key_reads_only_its_namespace_and_cannot_act(gateway, raw, redis_url, namespaces):
    admin_ns, tenant_ns = namespaces
    with Client(redis_url, namespace=tenant_ns) as client:
        mine = client.submit(prompt="tenant job", max_tokens=1)
    raw.set(Keys(tenant_ns).webhooks_dead, "a string, not a stream")
    assert api(gateway, f"/jobs/{mine.job_id}", key=TENANT_KEY).json()["may_act"] is False
    assert api(gateway, "/jobs", key=TENANT_KEY, state="queued").json()["jobs"][0]["job_id"] == mine.job_id
    assert api(gateway, "/webhooks/dead", key=TENANT_KEY).json()["letters"] == []
    assert api(gateway, f"/jobs/{mine.job_id}", key=TENANT_KEY, ns=admin_ns).status_code == 403
    assert api(gateway, "/jobs", key=TENANT_KEY, ns=admin_ns, state="queued").status_code == 403
    assert api(gateway, f"/jobs/{mine.job_id}").status_code == 404  # the admin's own namespace holds no such job
    assert api(gateway, f"/jobs/{mine.job_id}", ns=tenant_ns).json()["may_act"] is True
    assert httpx.get(f"{gateway.url}/dashboard/api/jobs/{mine.job_id}").status_code == 401
    cancel = f"{gateway.url}/dashboard/api/jobs/{mine.job_id}/cancel"
    assert httpx.post(cancel, headers=act_headers(TENANT_KEY)).status_code == 403
    assert raw.hget(Keys(tenant_ns).job(mine.job_id), "cancel") is None
    assert httpx.post(cancel, params={"ns": tenant_ns}, headers=act_headers(ADMIN_KEY)).status_code == 200
    assert raw.hget(Keys(tenant_ns).job(mine.job_id), "cancel") == b"1"


def test_queued_waiting_and_running_add_up_whatever_a_replica_record_claims(gateway, raw, namespaces):
    keys = Keys(namespaces[0])
    stream = keys.interactive
    raw.xgroup_create(stream, "engines", id="0", mkstream=True)
    for i in range(4):
        raw.xadd(stream, {"json": json.dumps({"job_id": f"taken-{i}", "prompt": "x", "max_tokens": 1})})
    raw.xreadgroup("engines", "claimer", {stream: ">"}, count=3)  # 3 taken, 1 waits in the stream
    raw.hset(keys.replica("liar"), mapping={"state": "serving", "running": "1000"})
    raw.zadd(keys.replicas, {"liar": time.time() + 3600})

    def totals() -> dict:
        return api(gateway, "/overview").json()["totals"]

    wait_until(lambda: totals()["in_flight"] >= 3, 10, "the taken entries to be counted")
    seen = totals()
    assert seen["running"] == seen["in_flight"] and seen["waiting"] == 0  # capped: never more than were taken
    raw.hset(keys.replica("liar"), "running", "1e300")  # junk: not a count, read as none
    wait_until(lambda: totals()["running"] == 0, 10, "junk read as no running job")
    raw.hset(keys.replica("liar"), "running", "1")
    wait_until(lambda: totals()["running"] == 1, 10, "the record's running count")
    seen = totals()
    assert seen["queued"] + seen["waiting"] + seen["running"] == seen["queued"] + seen["in_flight"]
    assert seen["waiting"] == seen["in_flight"] - 1
