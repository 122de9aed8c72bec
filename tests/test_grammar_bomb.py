"""Grammar bombs (issue 39): a JSON schema of about 300 bytes whose patterns nest large
regex repetitions makes xgrammar's compile (and the serialization of what it compiled)
take gigabytes. Every compile of a producer's grammar runs in a worker process under a
memory, time and size bound (engine/grammar_worker.py): the bomb fails its own job once,
naming the field and the limit, and the replica, its other jobs and the offline LLM go on.

Each process under attack runs with its address space bounded (RLIMIT_AS), so a regression
fails these tests instead of exhausting the machine: the bomb itself is only ever compiled
in a process under RLIMIT_AS."""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_factory, fault_harness, however pytest is run

from fault_harness import JobLedger, spawner_fixture, wait_until  # noqa: E402

from conveyor.clients import Client  # noqa: E402
from conveyor.clients.errors import JobFailed  # noqa: E402
from conveyor.engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from conveyor.engine.grammar_compiler import GrammarCompiler, constraint_key  # noqa: E402
from conveyor.engine.grammar_worker import CompileLimits, CompileRefused, GrammarWorker  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
# 4 patterns, 334 bytes: unbounded, the compile and its JSON take over 1 GiB (measured below,
# under a limit); with a real model's vocabulary (tens of thousands of tokens), gigabytes more
BOMB = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": r"(\w{1,999}|\d{1,%d}){1,999}" % (999 - i)} for i in range(4)
    },
}
SMALL = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
LIMITS = CompileLimits()  # the defaults a replica runs with
PROMPT = "def main():"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def address_space(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_info().vms


class Peak:
    """The largest RSS of a process and of its children, sampled on a thread."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.own = self.children = 0
        self.child_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(5)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.own = max(self.own, self.process.memory_info().rss)
                for child in self.process.children(recursive=True):
                    self.child_pids.add(child.pid)
                    self.children = max(self.children, child.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.02)


# ---------------------------------------------------------------- the bomb, and its bound


@pytest.fixture(scope="module")
def tokenizer_info(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    return compiler.info.serialize_json()


def test_unbounded_the_bomb_takes_over_a_gibibyte(tokenizer_info):
    """What the replica did before, in a worker under RLIMIT_AS of 1 GiB (never unconfined):
    xgrammar's compile and serialization of the bomb, stopped at the limit."""
    worker = GrammarWorker(tokenizer_info, CompileLimits(memory_bytes=GiB, wall_s=60, max_grammar_bytes=4 * GiB))
    try:
        with pytest.raises(CompileRefused, match="limits? of 1024 MiB of memory") as refused:
            worker.compile(*constraint_key(StructuredOutputsParams(json=BOMB)))
        assert not refused.value.invalid
    finally:
        worker.close()


def test_limits_are_named_and_a_compile_over_time_is_stopped(tokenizer_info):
    worker = GrammarWorker(tokenizer_info, CompileLimits(wall_s=0.2, max_grammar_bytes=1000))
    try:
        with pytest.raises(CompileRefused, match="over the limit of 0.000953674 MiB"):
            worker.compile(*constraint_key(StructuredOutputsParams(json=SMALL)))
        with pytest.raises(CompileRefused, match="The parenthesis is not closed") as invalid:
            worker.compile("regex", "a(b", False)
        assert invalid.value.invalid and worker.starts == 1  # neither stops the worker
        # stopped by the wall-clock limit (its own message), not by finishing
        with pytest.raises(CompileRefused, match=r"took longer than the limit of 0.2 s \(stopped\)") as slow:
            worker.compile(*constraint_key(StructuredOutputsParams(json=BOMB)))
        assert not slow.value.invalid
        assert worker.starts == 2  # the next worker, started at once
    finally:
        worker.close()
    assert CompileLimits.from_env({"CONVEYOR_GRAMMAR_MEMORY_MB": "0", "CONVEYOR_GRAMMAR_MAX_MB": "x"}) == LIMITS
    assert CompileLimits.from_env({"CONVEYOR_GRAMMAR_TIMEOUT_S": "3"}).wall_s == 3
    assert CompileLimits.from_env({}) == LIMITS


# ---------------------------------------------------------------- the offline LLM


@pytest.fixture
def address_space_limit():
    """This process's address space bounded (soft RLIMIT_AS: now + 1 GiB) for the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = address_space() + GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_offline_the_bomb_fails_its_request_alone(tiny_model, address_space_limit):
    llm = LLM(tiny_model, kv_cache_memory="64MiB", seed=0)
    normal = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=SMALL))
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate([PROMPT, PROMPT], [normal, plain], use_tqdm=False)
    bomb = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=BOMB))
    started = time.monotonic()
    outputs = llm.generate([PROMPT, PROMPT, PROMPT], [bomb, normal, plain], use_tqdm=False)
    took = time.monotonic() - started
    failed = outputs[0]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error.startswith("structured_outputs.json: the JSON schema was not compiled")
    assert "640 MiB" in failed.error, failed.error
    assert [o.outputs[0].token_ids for o in outputs[1:]] == [o.outputs[0].token_ids for o in alone]
    print(f"\noffline: the bomb's request failed in {took:.1f} s")  # a figure, not a gate: the box may be loaded
    worker = llm.engine.inputs._grammars.worker
    assert worker.starts == 2  # the one the bomb stopped, and the next (started at once)
    llm.engine.inputs._grammars.close()


# ---------------------------------------------------------------- a replica


@pytest.fixture
def spawn(request, tmp_path, redis_url):
    yield from spawner_fixture(request, tmp_path, redis_url)


def test_a_replica_fails_the_bomb_job_alone_and_keeps_serving(spawn, tiny_model, redis_url, namespace, redis_client):
    replica = spawn(namespace, "bomb-replica", tiny_model).start().wait_ready()
    pid = replica.pid
    limit = address_space(pid) + GiB
    psutil.Process(pid).rlimit(psutil.RLIMIT_AS, (limit, limit))  # a regression fails here, not the machine
    client = Client(redis_url, namespace=namespace)
    normal = dict(max_tokens=12, temperature=0, structured_outputs={"json": SMALL})
    plain = dict(max_tokens=12, temperature=0)
    # without the attack (this starts the grammar worker: the bomb's time below is its own)
    baseline = [client.submit(PROMPT, **normal).result(timeout=60), client.submit(PROMPT, **plain).result(timeout=60)]
    (worker,) = [c for c in psutil.Process(pid).children() if "grammar_worker" in " ".join(c.cmdline())]
    worker_limit = worker.rlimit(psutil.RLIMIT_AS)[0]
    replica_rss, worker_rss = psutil.Process(pid).memory_info().rss, worker.memory_info().rss
    assert worker_limit <= worker.memory_info().vms + LIMITS.memory_bytes + 64 * MiB  # bounded on its own
    tool = {"type": "function", "function": {"name": "fill", "parameters": BOMB}}
    with Peak(pid) as peak:
        started = time.monotonic()
        bomb = client.submit(PROMPT, max_tokens=12, structured_outputs={"json": BOMB})
        others = [client.submit(PROMPT, **normal), client.submit(PROMPT, **plain)]
        with pytest.raises(JobFailed) as failure:
            bomb.result(timeout=60)
        took = time.monotonic() - started
        results = [job.result(timeout=60) for job in others]
        tool_bomb = client.submit(
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=12,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "fill"}},
        )
        with pytest.raises(JobFailed) as tool_failure:
            tool_bomb.result(timeout=60)
        after = client.submit(PROMPT, **normal).result(timeout=60)
    assert failure.value.code == "invalid_request"
    assert failure.value.reason.startswith("structured_outputs.json: the JSON schema was not compiled")
    assert "640 MiB" in failure.value.reason, failure.value.reason
    assert tool_failure.value.code == "invalid_request" and "640 MiB" in tool_failure.value.reason
    print(f"\nreplica: the bomb's job failed in {took:.1f} s")  # a figure, not a gate: the box may be loaded
    assert [r.token_ids for r in results] == [b.token_ids for b in baseline]
    assert after.token_ids == baseline[0].token_ids
    # the replica took no harm: same process, its memory under 1 GiB, the worker bounded
    assert replica.alive() and replica.pid == pid
    assert peak.own < GiB, f"replica RSS peaked at {peak.own / MiB:.0f} MiB"
    cost = peak.own - replica_rss + peak.children - worker_rss
    assert peak.children - worker_rss <= LIMITS.memory_bytes and cost < GiB, f"the bomb cost {cost / MiB:.0f} MiB"
    assert len(peak.child_pids | {worker.pid}) >= 2  # the bomb's worker was stopped and replaced
    # failed once: attempt 1, never re-delivered, no dead letter as a crash
    ledger = JobLedger(redis_client, namespace)
    for job_id in (bomb.job_id, tool_bomb.job_id):
        record = ledger.record(job_id)
        assert record.attempt == 1 and record.status == "error" and len(record.terminals) == 1
    assert not [d for d in ledger.dead_letters() if bomb.job_id.encode() in json.dumps(str(d)).encode()]
    time.sleep(0.5)
    assert ledger.record(bomb.job_id).attempt == 1
    wait_until(lambda: replica.alive(), 1, "the replica")
    print(
        f"BOMB: failed in {took:.2f} s; replica RSS {replica_rss / MiB:.0f} -> peak {peak.own / MiB:.0f} MiB, "
        f"grammar worker RSS {worker_rss / MiB:.0f} -> peak {peak.children / MiB:.0f} MiB "
        f"(its RLIMIT_AS {worker_limit / MiB:.0f} MiB)"
    )
