"""The engine core (engine/engine_core.py, actors/engine_client.py) in its own process: what
`conveyor serve` runs by default. Real replicas on the session's Valkey; the core process is
found as the replica's child and faults are real signals to it."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time

import psutil
import pytest
from fault_harness import JobLedger, spawner_fixture, start_all, wait_until

from conveyor.clients import Client
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.errors import ModelLoadError


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(request, tmp_path, redis_url, engine_process=True)


def core_of(replica) -> psutil.Process:
    """The replica's engine core: its child running engine.engine_core."""

    def find():
        children = psutil.Process(replica.pid).children()
        return next((c for c in children if "conveyor.engine.engine_core" in " ".join(c.cmdline())), None)

    return wait_until(find, 30, f"the engine core process of {replica.consumer}")


def greedy(index: int, max_tokens: int = 24) -> dict:
    return {
        "prompt_token_ids": [3 + index, 9, 4, 17 + index],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_the_core_process_ignores_ctrl_c_matches_the_offline_engine_and_drains_on_sigterm(
    spawn, tiny_model, redis_url, namespace
):
    """One replica (each start costs two interpreters) through the core's life: a Ctrl-C and
    a SIGTERM sent to the core alone are ignored (a terminal's Ctrl-C reaches the whole
    process group, `docker stop` without an init signals it too), then its jobs match the
    offline engine token for token, then the replica's SIGTERM drains through the core."""
    replica = start_all([spawn(namespace, "core-a", tiny_model, grace_s=30)])[0]
    core = core_of(replica)
    assert core.ppid() == replica.pid
    os.kill(core.pid, signal.SIGINT)
    os.kill(core.pid, signal.SIGTERM)
    client = Client(redis_url, namespace=namespace)
    jobs = [client.submit(**greedy(i)) for i in range(6)]
    structured = client.submit(
        prompt_token_ids=[5, 6, 7], max_tokens=40, temperature=0, structured_outputs={"regex": "(yes|no)-[ab]{3}"}
    )
    results = [job.result(timeout=120) for job in jobs]
    assert core.is_running() and replica.alive()
    with LLM(tiny_model, num_kv_blocks=256) as llm:
        expected = llm.generate(
            [greedy(i)["prompt_token_ids"] for i in range(6)],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
    assert [r.token_ids for r in results] == [list(o.token_ids) for o in expected]
    text = structured.result(timeout=120).text  # the grammar crossed to the core and held
    assert re.fullmatch("(yes|no)-[ab]{3}", text), text

    # 1,000 tokens: still running when polled, however fast the CPU (200 ended between polls)
    job = client.submit(**greedy(1, max_tokens=1000))
    wait_until(lambda: client.job(job.job_id).status().status == "running", 30, "the job to start")
    replica.sigterm()
    assert len(job.result(timeout=60).token_ids) == 1000  # finished within the grace period
    assert replica.wait(30) == 0, replica.log_tail()
    wait_until(lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE, 10, "the core to stop")


def test_a_dead_core_stops_its_replica_and_another_finishes_the_jobs(spawn, tiny_model, redis_url, namespace, raw):
    """Then the survivor's front door is killed (-9): its core dies with it."""
    victim, survivor = start_all([spawn(namespace, f"core-{n}", tiny_model, lease_s=2.0) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    jobs = [client.submit(**greedy(i, max_tokens=400)) for i in range(4)]
    wait_until(lambda: any(ledger.record(j.job_id).tokens for j in jobs), 60, "tokens from some job")
    survivor_core = core_of(survivor)
    core_of(victim).kill()  # SIGKILL, as the OOM killer would
    assert victim.wait(30) == 1, victim.log_tail()
    assert "engine core" in victim.log_text() and "exited with code -9" in victim.log_text()
    results = [job.result(timeout=180) for job in jobs]
    assert all(len(r.token_ids) == 400 for r in results)
    assert ledger.summary([j.job_id for j in jobs])["lost"] == 0
    assert survivor.alive() and survivor_core.is_running()
    survivor.kill9()
    wait_until(
        lambda: not survivor_core.is_running() or survivor_core.status() == psutil.STATUS_ZOMBIE,
        10,
        "the core to die with its front door",
    )


def test_a_model_that_cannot_load_fails_as_in_process(tmp_path):
    from conveyor.actors.engine_client import EngineCoreClient
    from conveyor.engine import EngineConfig

    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="model") as in_core:
        EngineCoreClient.in_child_process(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError) as on_thread:
        EngineCoreClient.on_thread(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError) as in_process:
        LLM(str(tmp_path / "missing"))
    assert str(in_core.value) == str(in_process.value) == str(on_thread.value)
    assert time.monotonic() - started < 60


def test_a_compiled_grammar_crosses_processes_and_is_adopted_once(tiny_model):
    from transformers import AutoTokenizer

    from conveyor.engine.grammar_compiler import GrammarCompiler
    from conveyor.engine.structured_outputs import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sender = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id or 0})
    receiver = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id or 0})
    grammar = sender.compile(StructuredOutputsParams(regex="[ab]{3}"))
    wire = pickle.loads(pickle.dumps(grammar))
    assert wire.compiled is None and wire.key == grammar.key
    adopted = receiver.adopt(wire)
    assert adopted.compiled is not None and adopted.key == grammar.key
    assert receiver.adopt(pickle.loads(pickle.dumps(grammar))) is adopted  # the second comes from the cache
    assert str(adopted.compiled.grammar) == str(grammar.compiled.grammar)


def test_a_load_error_that_cannot_be_pickled_still_reaches_the_front_door():
    from conveyor.engine.engine_core import portable
    from conveyor.engine.errors import InvalidRequest

    unpicklable = InvalidRequest("model", "whatever went wrong")  # its __init__ takes two arguments
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(unpicklable))
    sent = pickle.loads(pickle.dumps(portable(unpicklable)))
    assert isinstance(sent, ModelLoadError) and "whatever went wrong" in str(sent)
    same = ModelLoadError("model: missing")
    assert portable(same) is same
