"""The Batch API end to end: the real OpenAI SDK against real gateways (threads, and
subprocesses for kill -9), a real replica of a tiny model, a real Valkey; and
`conveyor batch` as a subprocess, interrupted and resumed. Output bodies are checked
against the offline engine (`engine.LLM`, greedy)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis
from fault_harness import JobLedger, wait_until
from gateway_harness import GatewayProcess, GatewayThread, openai_client
from replica_harness import ReplicaThread
from scratch import scratch_namespace

from conveyor.apps.openai_api.batch_cli import _ids as cli_batch_ids
from conveyor.apps.openai_api.batch_runner import BatchRun, Lease, RunnerSettings, default_endpoints
from conveyor.apps.openai_api.batch_store import BatchKeys, BatchStore
from conveyor.clients.keys import Keys
from conveyor.gateway import batch_routes

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
FAST = RunnerSettings(lease_s=2.0, poll_s=0.05, scan_s=0.1, cancel_wait_s=5.0)
FAST_ENV = {
    "CONVEYOR_BATCH_LEASE_S": "2",
    "CONVEYOR_BATCH_POLL_S": "0.05",
    "CONVEYOR_BATCH_SCAN_S": "0.1",
    "CONVEYOR_BATCH_MAX_IN_FLIGHT": "1",
}
DONE = ("completed", "failed", "cancelled", "expired")
# `conveyor gateway` with the batch router mounted (as the lead mounts it in the command)
GATEWAY_WITH_BATCH = (
    "import sys\nfrom conveyor.gateway import server, batch_routes\nserve = server.serve\n"
    "server.serve = lambda settings, extra_routers=(): serve(settings, (batch_routes.router,))\n"
    "from conveyor.cli import main\nsys.exit(main(['gateway', *sys.argv[1:]]))"
)


@pytest.fixture(scope="module")
def ns(redis_url):
    with scratch_namespace(redis_url, "batch") as namespace:
        yield namespace


@pytest.fixture(scope="module")
def replica(tiny_model, redis_url, ns, one_torch_thread):
    with ReplicaThread(
        tiny_model,
        redis_url,
        ns,
        consumer="batch-replica",
        served_model_name=MODEL,
        max_num_seqs=8,
        kv_cache_memory="64MiB",
    ) as running:
        wait_until(lambda: redis.Redis.from_url(redis_url).exists(Keys(ns).model_info(MODEL)), 30, "model info")
        yield running


@pytest.fixture(scope="module")
def reference(tiny_model, one_torch_thread):
    """Greedy text of a request body, from the offline engine."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(tiny_model, kv_cache_memory="64MiB")

    def text_of(body: dict) -> str:
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=body.get("ignore_eos", False))
        if "messages" in body:
            return llm.chat(body["messages"], params, use_tqdm=False)[0].text
        return llm.generate([body["prompt"]], params, use_tqdm=False)[0].text

    return text_of


def batch_gateway(redis_url: str, ns: str, settings: RunnerSettings = FAST) -> GatewayThread:
    """A gateway thread with the Batch API, its runner loop on `settings` (set before it starts)."""
    gateway = GatewayThread(redis_url, ns, extra_routers=(batch_routes.router,))
    gateway.server.config.app.state.batch_settings = settings
    return gateway


@pytest.fixture
def gateway(redis_url, ns, replica):
    with batch_gateway(redis_url, ns) as running:
        yield running


def raw(redis_url):
    return redis.Redis.from_url(redis_url)


def chat_line(i: int, max_tokens: int = 12, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"def f{i}(x):"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(i: int, max_tokens: int = 12) -> dict:
    body = {"model": MODEL, "prompt": f"class C{i}:", "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def submit_batch(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions", **options):
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **options)


def wait_batch(client: openai.OpenAI, batch_id: str, statuses=DONE, timeout: float = 60.0):
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout,
        f"batch {batch_id} to reach {statuses}",
        interval=0.1,
    )


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {(line := json.loads(text))["custom_id"]: line for text in client.files.content(file_id).text.splitlines()}


def output_text(line: dict) -> str:
    choice = line["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def check_ran_once(redis_url: str, ns: str, job_ids: list[str]) -> None:
    """Every job has exactly one terminal event, from its first attempt: none ran twice."""
    ledger = JobLedger(raw(redis_url), ns)
    assert ledger.summary(job_ids)["duplicates"] == 0
    records = ledger.records(job_ids)
    assert all(len(r.terminals) <= 1 and r.attempt <= 1 for r in records.values()), records


# ---------------------------------------------------------------- the whole round trip


def test_batch_output_equals_the_offline_engine(gateway, reference, redis_url, ns):
    client = openai_client(gateway)
    lines = [chat_line(i) for i in range(5)] + [chat_line(99, max_tokens=5000)]  # the last: over max_model_len
    batch = submit_batch(client, lines, metadata={"run": "round-trip"})
    assert batch.status == "validating" and batch.metadata == {"run": "round-trip"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
    assert batch.model == MODEL and batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.usage.output_tokens > 0

    outputs, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    for line in lines[:5]:
        out = outputs[line["custom_id"]]
        assert out["response"]["status_code"] == 200 and out["error"] is None
        assert out["response"]["body"]["object"] == "chat.completion"
        assert out["response"]["body"]["id"] == "chatcmpl-" + out["response"]["request_id"]
        assert output_text(out) == reference(line["body"]), line["custom_id"]
    failed = errors["chat-99"]["response"]
    assert failed["status_code"] == 400 and failed["body"]["error"]["code"] == "invalid_request"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    check_ran_once(redis_url, ns, [o["response"]["request_id"] for o in [*outputs.values(), *errors.values()]])

    completions = [completion_line(i) for i in range(3)]
    second = wait_batch(client, submit_batch(client, completions, endpoint="/v1/completions").id)
    texts = {cid: output_text(line) for cid, line in lines_of(client, second.output_file_id).items()}
    assert texts == {line["custom_id"]: reference(line["body"]) for line in completions}

    listed = [b.id for b in client.batches.list(limit=1)]  # the SDK pages through with `after`
    assert listed[:2] == [second.id, batch.id]


def test_junk_in_the_batch_records_costs_only_itself(gateway, reference, redis_url, ns):
    """Producers of the namespace can write the runners' keys: junk ids in the active set
    (non-ASCII bytes, newlines, thousands of them), a batch hash that is a string and one full
    of junk leave the runner serving real batches."""
    store = raw(redis_url)
    active = f"{ns}:batches:active"
    store.sadd(active, b"\xff\xfe", b"batch_x\n", "batch with spaces", *[f"junk:{i}" for i in range(3000)])
    store.set(f"{ns}:batch:batch_string", "not a hash")
    store.hset(f"{ns}:batch:batch_junk", mapping={"status": "in_progress", "input_file_id": "\x00", "created_at": "x"})
    store.sadd(active, "batch_string", "batch_junk")
    client = openai_client(gateway)
    lines = [chat_line(i) for i in range(2)]
    batch = wait_batch(client, submit_batch(client, lines).id)
    assert batch.status == "completed", batch
    texts = {cid: output_text(line) for cid, line in lines_of(client, batch.output_file_id).items()}
    assert texts == {line["custom_id"]: reference(line["body"]) for line in lines}
    # each scan samples the set and forgets the junk it sees: gone within a few scans
    wait_until(
        lambda: not any(m.startswith(b"junk:") or m in (b"\xff\xfe", b"batch_x\n") for m in store.smembers(active)),
        30,
        "the runner to forget junk ids",
    )
    assert client.models.list().data, "the gateway stopped serving"


def test_files_and_batch_requests_are_checked(gateway):
    client = openai_client(gateway)
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    assert client.files.retrieve(uploaded.id).bytes == len(jsonl([chat_line(0)]))
    assert client.files.content(uploaded.id).content == jsonl([chat_line(0)])
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match="over the limit of 50000") as too_many:
        client.files.create(file=("big.jsonl", b"{}\n" * 50_001), purpose="batch")
    assert too_many.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope:x")  # ids never reach a key name unchecked
    for bad in (
        {"endpoint": "/v1/embeddings"},
        {"completion_window": "1h"},
        {"input_file_id": "file-nope"},
        {"metadata": {"k": "v" * 513}},
    ):
        options = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **bad}
        with pytest.raises(openai.BadRequestError):
            client.batches.create(**options)


def test_invalid_input_fails_the_batch_with_errors(gateway):
    client = openai_client(gateway)
    lines = [
        chat_line(0),
        b"not json",
        chat_line(0),
        {**chat_line(1), "method": "GET"},
        {**chat_line(2), "url": "/v1/completions"},
        chat_line(3, frobnicate=1),
        {**chat_line(4), "custom_id": None},
        chat_line(5, model="no-such-model"),
        chat_line(6, logprobs=True),
    ]
    batch = wait_batch(client, submit_batch(client, lines).id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert errors == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_method", "method"),
        (5, "invalid_url", "url"),
        (6, "unrecognized_argument", "body.frobnicate"),
        (7, "invalid_custom_id", "custom_id"),
        (8, "model_not_found", "body.model"),
        (9, "unsupported_value", "body.logprobs"),
    ]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


# ---------------------------------------------------------------- cancel and expiry


def test_cancel_keeps_the_finished_lines(redis_url, ns, replica, reference):
    slow = RunnerSettings(**{**FAST.__dict__, "max_in_flight": 1})
    with batch_gateway(redis_url, ns, slow) as gateway:
        client = openai_client(gateway)
        lines = [chat_line(i, max_tokens=48, ignore_eos=True) for i in range(12)]
        batch = submit_batch(client, lines)
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "two lines")
        assert client.batches.cancel(batch.id).status == "cancelling"
        batch = wait_batch(client, batch.id)
        outputs = lines_of(client, batch.output_file_id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    assert 2 <= len(outputs) == batch.request_counts.completed < 12
    for custom_id, out in outputs.items():
        assert output_text(out) == reference(lines[int(custom_id.split("-")[1])]["body"])
    statuses = JobLedger(raw(redis_url), ns).statuses(_job_ids(redis_url, ns, batch))
    assert statuses.count("done") == len(outputs) and set(statuses) <= {"done", "cancelled", None}


def _job_ids(redis_url: str, ns: str, batch) -> list[str]:
    from conveyor.apps.openai_api.batch_runner import parse_input

    content = raw(redis_url).get(BatchKeys(ns).file_content(batch.input_file_id))
    return [line.job_id for line in parse_input(content, batch.id, batch.endpoint, default_endpoints())[0]]


def test_a_batch_past_its_window_expires(redis_url, ns, replica):
    batch, errors = asyncio.run(_expire_a_batch(redis_url, ns))
    assert batch["status"] == "expired" and batch["expired_at"]
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_expired"] * 2


async def _expire_a_batch(redis_url: str, ns: str):
    """A batch whose window ended before it ran (its expires_at set in the past)."""
    from conveyor.clients import AsyncClient

    async with AsyncClient(redis_url, ns) as client:
        store = BatchStore(client.redis, ns)
        uploaded = await store.put_file(jsonl([chat_line(0), chat_line(1)]), filename="x.jsonl", purpose="batch")
        batch, _ = await store.create_batch(
            input_file_id=uploaded["id"], endpoint="/v1/chat/completions", completion_window="24h", metadata={}
        )
        await client.redis.hset(BatchKeys(ns).batch(batch["id"]), "expires_at", int(time.time()) - 1)
        lease = Lease(store, batch["id"], "test", FAST)
        assert await lease.claim()
        try:
            assert await BatchRun(store, client, batch["id"], lease, FAST).run() == "expired"
        finally:
            await lease.release()
        batch = await store.get_batch(batch["id"])
        return batch, (await store.file_content(batch["error_file_id"])).decode().splitlines()


# ---------------------------------------------------------------- a gateway dies mid-batch


def test_killed_gateway_batch_is_finished_by_another(redis_url, ns, replica, reference, tmp_path):
    gateways = [GatewayProcess(redis_url, tmp_path, ns, env=FAST_ENV, name=f"gw{i}") for i in range(2)]
    for gateway in gateways:
        gateway.command = [sys.executable, "-c", GATEWAY_WITH_BATCH, *gateway.command[2:]]
        gateway.start()
    try:
        for gateway in gateways:
            gateway.wait_ready()
        client = openai_client(gateways[0])
        lines = [chat_line(i, max_tokens=32, ignore_eos=True) for i in range(14)]
        batch = submit_batch(client, lines)
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 60, "three lines")
        owner = raw(redis_url).get(BatchKeys(ns).lease(batch.id)).decode()
        victim = next(g for g in gateways if f":{g.process.pid}:" in owner)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        survivor = next(g for g in gateways if g is not victim)
        mid = openai_client(survivor).batches.retrieve(batch.id)
        assert mid.status == "in_progress" and mid.request_counts.completed < 14  # the rest is the survivor's
        batch = wait_batch(openai_client(survivor), batch.id, timeout=60)
    finally:
        for gateway in gateways:
            gateway.stop()
    assert batch.status == "completed" and batch.request_counts.completed == 14
    check_ran_once(redis_url, ns, _job_ids(redis_url, ns, batch))
    content = raw(redis_url).get(BatchKeys(ns).file_content(batch.output_file_id)).decode().splitlines()
    outputs = {(line := json.loads(text))["custom_id"]: line for text in content}
    assert {cid: output_text(o) for cid, o in outputs.items()} == {
        line["custom_id"]: reference(line["body"]) for line in lines
    }


# ---------------------------------------------------------------- conveyor batch


# `python -m conveyor` with SIGINT at its default, as a terminal's foreground command has it. A
# process a shell starts in the background (`.ci/run &`, nohup) inherits SIGINT ignored, and
# Python keeps it ignored: the CLI then ran through a Ctrl-C (three CI runs of this session)
CONVEYOR_AS_IN_A_TERMINAL = (
    "import runpy, signal\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "runpy.run_module('conveyor', run_name='__main__', alter_sys=True)"
)


def conveyor_batch(redis_url: str, ns: str, source: Path, target: Path, *flags: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-c",
        CONVEYOR_AS_IN_A_TERMINAL,
        "batch",
        str(source),
        str(target),
        "--redis-url",
        redis_url,
        "--namespace",
        ns,
        "--lease-s",
        "2",
        "--wait-s",
        "10",
        *flags,
    ]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


CTRL_C_AFTER_TWO_LINES = """
import os, signal, sys, time
import redis
url, batch_key, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn, ends = redis.Redis.from_url(url), time.monotonic() + 60
while int(conn.hget(batch_key, "completed") or 0) < 2:
    if time.monotonic() > ends:
        sys.exit("no two lines recorded within 60 s")
    time.sleep(0.02)
try:
    os.kill(pid, signal.SIGINT)
except ProcessLookupError:
    sys.exit("the batch run had ended before two lines were seen")
"""


def test_conveyor_batch_resumes_after_ctrl_c(redis_url, ns, replica, reference, tmp_path):
    # long enough lines that a loaded box still sees the run in its middle
    lines = [chat_line(i, max_tokens=96, ignore_eos=True) for i in range(6)] + [completion_line(i) for i in range(4)]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    batch_id, _ = cli_batch_ids(source.read_bytes(), MODEL)
    batch_key = BatchKeys(ns).batch(batch_id)

    first = conveyor_batch(redis_url, ns, source, target, "--max-in-flight", "1")
    # a process of its own sends the Ctrl-C once two lines are recorded
    interrupter = subprocess.run(
        [sys.executable, "-c", CTRL_C_AFTER_TWO_LINES, redis_url, batch_key, str(first.pid)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    _, stderr = first.communicate(timeout=30)
    assert interrupter.returncode == 0, f"{interrupter.stdout}{interrupter.stderr}\n{stderr}"
    assert first.returncode == 130, stderr
    assert "run the same command again" in stderr and not target.exists()
    assert raw(redis_url).pttl(BatchKeys(ns).lease(batch_id)) == -2  # released on the way out
    recorded = int(raw(redis_url).hget(batch_key, "completed")) + int(raw(redis_url).hget(batch_key, "failed") or 0)

    second = conveyor_batch(redis_url, ns, source, target, "--model", MODEL, "--quiet")
    _, stderr = second.communicate(timeout=90)
    assert second.returncode == 0, stderr
    submitted, reused = map(int, re.search(r"jobs (\d+) submitted, (\d+) reused", stderr).groups())
    assert submitted + reused == len(lines) - recorded and reused <= 1  # at most the one in flight at Ctrl-C

    written = [json.loads(text) for text in target.read_text().splitlines()]
    assert [w["custom_id"] for w in written] == [line["custom_id"] for line in lines]  # input order
    assert [output_text(w) for w in written] == [reference(line["body"]) for line in lines]
    check_ran_once(redis_url, ns, [w["response"]["request_id"] for w in written])

    third = conveyor_batch(redis_url, ns, source, tmp_path / "again.jsonl", "--quiet")
    _, stderr = third.communicate(timeout=60)
    assert third.returncode == 0 and "all jobs reused" in stderr, stderr
    assert (tmp_path / "again.jsonl").read_text() == target.read_text()
