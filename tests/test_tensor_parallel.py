"""Tensor parallelism over torch.distributed (gloo on CPU): two real processes per engine.

Greedy output at tensor_parallel_size=2 is token-identical to transformers for the tiny
Llama, Qwen2 and Qwen3 models, with ample KV and under preemption; each decode step moves
what the design says (two all-reduces of the hidden states per layer, a plan of a few
bytes per sequence); a rank killed with SIGKILL ends the engine with a clear error in
bounded time, offline and in a replica (whose jobs another replica then reclaims)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from fault_harness import JobLedger, pending_owners, spawner_fixture, wait_until
from model_factory import build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts

from conveyor.clients import Client
from conveyor.engine import LLM, ModelLoadError, SamplingParams
from conveyor.engine.distributed.launcher import RankFailed

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # each rank one thread: two ranks, two cores
NUM_PROMPTS = 12
REGIMES = {  # as tests/test_exactness.py
    "ample_kv": {},
    "overlapped_preemption": dict(async_scheduling=True, num_kv_blocks=64, block_size=4),
    # drafts travel in the plan; what verification keeps of them comes back in the next one's tails
    "speculative": dict(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    ),
}
HIDDEN, LAYERS = 64, 2  # the tiny models' (tests/model_factory.py)
RANK_EXIT_BOUND_S = 15.0


# Every family with ample KV (what sharding each family's weights must get right: Qwen2's
# biases, Qwen3's q/k norms), and each other regime once (what TP adds to the engine's
# paths, the same for every family). The full cross of the two repeated the first row's
# coverage at a rank start (~5 s) per case. Plain preemption with chunked prefill under TP:
# tests/test_pipeline_parallel.py's pipeline x tensor case.
CASES = [
    ("llama", "ample_kv"),
    ("qwen2", "ample_kv"),
    ("qwen3", "ample_kv"),
    ("llama", "speculative"),
    ("qwen2", "overlapped_preemption"),
]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {family: build_tiny_model(family, tmp_path_factory.mktemp(f"tp_{family}")) for family in dict(CASES)}


@pytest.fixture(scope="module")
def workloads(tiny_models):
    prompts = mixed_prompts(768, n=NUM_PROMPTS, seed=1, min_len=1, max_len=200)
    max_tokens = mixed_max_tokens(NUM_PROMPTS, seed=1, low=1, high=40)
    return {
        family: (prompts, max_tokens, [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)])
        for family, model in tiny_models.items()
    }


@pytest.mark.parametrize("family, regime", CASES)
def test_tp2_greedy_matches_transformers(tiny_models, workloads, family, regime):
    tiny_model, (prompts, max_tokens, expected) = tiny_models[family], workloads[family]
    with LLM(tiny_model, tensor_parallel_size=2, **REGIMES[regime]) as llm:
        outputs = llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False
        )
        stats = llm.engine.stats()
        worker = llm.engine.runner.workers.processes[0]
        if (family, regime) == CASES[0]:
            check_communication_per_decode_step(llm.engine)
    for output, want in zip(outputs, expected):
        assert output.error is None
        assert output.token_ids == want, f"request {output.request_id} differs"
    assert stats["num_running"] == stats["num_waiting"] == 0
    if regime.endswith("preemption"):
        assert stats["num_preemptions"] > 0
    if regime == "speculative":
        assert stats["spec_decode_num_draft_tokens"] > 0
    # every forward: one all-reduce after attention and one after the MLP per layer
    assert stats["tp_num_all_reduces"] > 0 and stats["tp_num_all_reduces"] % (2 * LAYERS) == 0
    assert worker.poll() == 0, "the worker rank should have stopped cleanly on close()"


def check_communication_per_decode_step(engine) -> None:
    """A decode step of B sequences all-reduces 2 x layers x B x hidden floats and sends a
    plan of a few bytes per sequence (ids, counts, new blocks, the last sampled token).
    Checked on the first case's engine, once it is idle (a rank start costs ~5 s)."""
    batch = 8
    for index, prompt in enumerate(mixed_prompts(768, n=batch, seed=5, min_len=20, max_len=20)):
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # the prompts (and each one's first token)
    engine.step()  # first decode step: sends the prefill's sampled tokens
    before = engine.stats()
    engine.step()  # a decode step like any other
    after = engine.stats()
    for index in range(batch):
        engine.abort_request(f"r{index}")
    reduced = after["tp_bytes_all_reduced"] - before["tp_bytes_all_reduced"]
    plan = after["tp_plan_bytes"] - before["tp_plan_bytes"]
    assert after["tp_num_all_reduces"] - before["tp_num_all_reduces"] == 2 * LAYERS
    assert reduced == 2 * LAYERS * batch * HIDDEN * 4  # float32 hidden states, this rank's share
    assert plan < 16 + 24 * batch, f"plan of {plan} bytes for {batch} decoding sequences"
    print(
        f"TP=2 decode step, batch {batch}: {reduced // (batch * LAYERS)} bytes all-reduced per token per layer, "
        f"plan {plan} bytes ({plan / batch:.1f} per sequence)"
    )


def test_unsplittable_models_are_refused_before_any_rank_starts(tmp_path):
    llama = build_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3: the model's num_attention_heads \(4\)"):
        LLM(llama, tensor_parallel_size=3)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=2: only the Llama family"):
        LLM(build_tiny_model("gpt2", tmp_path / "gpt2"), tensor_parallel_size=2)
    with pytest.raises(ModelLoadError, match=r"GGUF blocks are not split"):
        LLM(llama, tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: must be an integer >= 1, got 0"):
        LLM(llama, tensor_parallel_size=0)


def test_killed_rank_ends_offline_generation_with_a_clear_error(tmp_path):
    model = build_tiny_model("llama", tmp_path / "llama")
    prompts = mixed_prompts(768, n=8, seed=7, min_len=10, max_len=60)
    llm = LLM(model, tensor_parallel_size=2)
    worker = llm.engine.runner.workers.processes[0]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # the ranks work
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RankFailed, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=900, ignore_eos=True), use_tqdm=False)
    finally:
        killer.join()
    assert time.monotonic() - started < RANK_EXIT_BOUND_S
    closing = time.monotonic()
    llm.close()
    assert time.monotonic() - closing < 5


def test_hung_rank_fails_the_step_after_the_timeout(tmp_path, monkeypatch):
    """SIGSTOP: the rank keeps its sockets open but answers nothing; a step outlasting
    CONVEYOR_TP_TIMEOUT_S gets it killed and fails instead of waiting for ever."""
    monkeypatch.setenv("CONVEYOR_TP_TIMEOUT_S", "3")
    llm = LLM(build_tiny_model("llama", tmp_path / "llama"), tensor_parallel_size=2)
    worker = llm.engine.runner.workers.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(RankFailed, match=r"rank 1 .* exited with code -9 \(killed: a step outlasted"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert 3 <= time.monotonic() - started < RANK_EXIT_BOUND_S
    finally:
        worker.kill()  # (a no-op once reaped)
        llm.close()


def test_follower_ranks_exit_when_rank_0_is_killed(tmp_path):
    model = build_tiny_model("llama", tmp_path / "llama")
    script = (
        "import sys, time; from conveyor import LLM; llm = LLM(sys.argv[1], tensor_parallel_size=2); "
        "print(llm.engine.runner.workers.processes[0].pid, flush=True); time.sleep(600)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, "-c", script, model], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker_pid = int(driver.stdout.readline())
        driver.kill()
        driver.wait(10)
        wait_until(lambda: not _alive(worker_pid), RANK_EXIT_BOUND_S, "the follower rank to exit")
    finally:
        driver.kill()
        if _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- under the replica's actors ----------------------------------------------------------


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(request, tmp_path, redis_url, engine_process=True)


def rank_pid(replica) -> int:
    match = wait_until(
        lambda: re.search(r"parallel rank 1 of 2: pid (\d+)", replica.log_text()),
        60,
        "the replica to log its worker rank",
    )
    return int(match.group(1))


def long_job(index: int) -> dict:
    return {"prompt_token_ids": [5, 6, 7, 8 + index], "max_tokens": 900, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_replica_with_a_killed_rank_exits_and_its_jobs_are_reclaimed(spawn, redis_url, namespace, raw, tmp_path, split):
    """Tensor parallel, and pipeline parallel (rank 1 is the second stage): the replica's
    jobs equal transformers' greedy ids (the offline result), and a killed rank makes it exit."""
    model = build_tiny_model("llama", tmp_path / "llama")
    one_seq = ["--max-num-seqs", "1"]  # each replica holds two jobs (credits: 2 x max_num_seqs)
    tp = spawn(namespace, "tp", model, lease_s=2.0, args=[split, "2", *one_seq])
    tp.start().wait_ready()
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    prompts = mixed_prompts(768, n=3, seed=9, min_len=5, max_len=40)
    short = client.submit_many(
        [{"prompt_token_ids": p, "max_tokens": 16, "temperature": 0} for p in prompts], progress=False
    )
    for prompt, job in zip(prompts, short):  # through the actors (overlapped steps): still exact
        assert job.result(timeout=60).token_ids == hf_greedy(model, prompt, 16)

    survivor = spawn(namespace, "survivor", model, lease_s=2.0, args=one_seq, engine_process=False)
    survivor.start().wait_ready()
    jobs = client.submit_many([long_job(i) for i in range(4)], progress=False)

    def held_by_tp():
        return {entry for entry, owner in pending_owners(raw, namespace).items() if owner == "tp"}

    wait_until(
        lambda: held_by_tp() and any(ledger.record(j.job_id).tokens for j in jobs), 60, "the TP replica to run a job"
    )
    worker_pid, held = rank_pid(tp), held_by_tp()
    os.kill(worker_pid, signal.SIGKILL)
    killed = time.monotonic()
    assert tp.wait(RANK_EXIT_BOUND_S) == 1
    exit_s = time.monotonic() - killed
    assert f"rank 1 (pid {worker_pid}) exited with code -9" in tp.log_text()
    print(f"replica exited {exit_s:.1f} s after its rank 1 was killed")

    results = [job.result(timeout=180) for job in jobs]
    assert all(len(r.token_ids) == 900 for r in results)
    records = ledger.records([job.job_id for job in jobs])
    assert all(rec.status == "done" and len(rec.terminals) == 1 for rec in records.values())
    assert sorted(survivor.reclaimed_entries()) == sorted(held)  # what the TP replica held, rerun elsewhere
    assert survivor.alive()
