"""Pipeline parallel over torch.distributed (gloo on CPU): real rank processes per engine.

Greedy output with the layers split into 2 stages (3 layers: 2 + 1), alone and with each
stage split over 2 tensor ranks, is token-identical to transformers under ample KV and
under forced preemption with chunked prefill; the engine keeps 2 steps in flight (the
stages overlap). Ranks on "other hosts" join only through the rendezvous address
(``conveyor rank``); a killed one ends the engine with a clear error. Splits that cannot
be served are refused at load with one line naming the option and the limit."""

import os
import signal
import socket
import subprocess
import sys

import pytest
from model_factory import build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts

from conveyor.engine import LLM, ModelLoadError, SamplingParams
from conveyor.engine.distributed.launcher import RankFailed
from conveyor.engine.distributed.pipeline import stage_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # each rank one thread: the box has two cores
NUM_PROMPTS = 10
LAYERS = 3  # splits unevenly over 2 stages
TIGHT = dict(num_kv_blocks=48, block_size=4, max_num_batched_tokens=32)  # preempts, chunks prompts
CASES = {
    "pp2": dict(pipeline_parallel_size=2, max_num_seqs=4),  # requests queue beyond the batch
    "pp2_preemption_chunked": dict(pipeline_parallel_size=2, **TIGHT),
    "pp2_tp2_preemption_chunked": dict(pipeline_parallel_size=2, tensor_parallel_size=2, **TIGHT),
}
RANK_EXIT_BOUND_S = 15.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("pp_llama"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def workload(llama):
    prompts = mixed_prompts(768, n=NUM_PROMPTS, seed=3, min_len=1, max_len=120)
    max_tokens = mixed_max_tokens(NUM_PROMPTS, seed=3, low=1, high=30)
    return prompts, max_tokens, [hf_greedy(llama, p, n) for p, n in zip(prompts, max_tokens)]


def test_stages_split_the_layers_contiguously_the_first_ones_longer():
    assert [list(stage_layers(3, 2, s)) for s in range(2)] == [[0, 1], [2]]
    assert [len(stage_layers(10, 4, s)) for s in range(4)] == [3, 3, 2, 2]
    assert [i for s in range(4) for i in stage_layers(10, 4, s)] == list(range(10))


@pytest.mark.parametrize("case", CASES)
def test_pipeline_greedy_matches_transformers(llama, workload, case):
    prompts, max_tokens, expected = workload
    with LLM(llama, **CASES[case]) as llm:
        outputs = llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False
        )
        stats = llm.engine.stats()
        workers = llm.engine.runner.workers.processes
        if case == "pp2":
            check_abort_in_flight(llm.engine, prompts, expected)
    for output, want in zip(outputs, expected):
        assert output.error is None
        assert output.token_ids == want, f"request {output.request_id} differs"
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["pp_max_steps_in_flight"] == 2  # the stages worked on two steps at once
    assert stats["pp_bytes_handed_on"] > 0
    if "preemption" in case:
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    if "tp2" in case:
        assert len(workers) == 3 and stats["tp_num_all_reduces"] > 0  # within stage 0: rank 0 and rank 1
    assert all(worker.poll() == 0 for worker in workers), "every rank stops cleanly on close()"


def check_abort_in_flight(engine, prompts, expected) -> None:
    """A request aborted while its step is in flight ends 'abort'; the others, whose steps
    reuse its blocks, keep transformers' ids, and a new request taking its id gets none of
    its prompt logprobs (on the case's engine, once idle)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0)
    for index in range(4):
        engine.add_request(f"a{index}", prompts[index], params)
    engine.step()  # launches a step with half the requests, returns before it ends
    engine.step()  # launches one with the other half, then finishes the first
    [in_flight] = engine._pipelined
    aborted = in_flight.scheduled[0].seq_id
    engine.abort_request(aborted)
    engine.add_request(aborted, [7, 8, 9], params)  # its id again, while its step is in flight
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    by_id = {o.request_id: o for o in finished if o.outputs[0].finish_reason != "abort"}
    assert [o.request_id for o in finished if o.outputs[0].finish_reason == "abort"] == [aborted]
    assert len(by_id[aborted].prompt_logprobs) == 3  # its own prompt's, not the aborted one's
    for index in range(4):
        if f"a{index}" != aborted:
            reference = hf_greedy(engine.config.model, prompts[index], 30, ignore_eos=True)
            assert by_id[f"a{index}"].outputs[0].token_ids == reference


def test_unservable_splits_are_refused_before_any_rank_starts(llama, tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"pipeline_parallel_size=4: the model has 3 layers, fewer than the stages"
    ):
        LLM(llama, pipeline_parallel_size=4)
    with pytest.raises(ModelLoadError, match=r"pipeline_parallel_size=2: only the Llama family"):
        LLM(build_tiny_model("gpt2", tmp_path / "gpt2"), pipeline_parallel_size=2)
    with pytest.raises(ModelLoadError, match=r"pipeline_parallel_size=2: GGUF blocks are not split"):
        LLM(llama, pipeline_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: must be an integer >= 1, got 0"):
        LLM(llama, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"nnodes: 2 ranks .* do not split evenly over 3 hosts"):
        LLM(llama, pipeline_parallel_size=2, nnodes=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2: speculative_config is not supported"):
        LLM(llama, pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"enable_lora: needs tensor_parallel_size 1, pipeline_parallel_size 1"):
        LLM(llama, pipeline_parallel_size=2, enable_lora=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_remote_rank(port: int, rank: int) -> subprocess.Popen:
    """``conveyor rank`` as another host runs it: it knows only the rendezvous address."""
    command = [sys.executable, "-P", "-m", "conveyor", "rank", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(port), "--rank", str(rank), "--threads", "1"]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def test_a_rank_of_another_host_joins_through_the_rendezvous_and_its_death_ends_the_engine(llama, workload):
    prompts, max_tokens, expected = workload
    port = free_port()
    remote = start_remote_rank(port, 1)
    try:
        with LLM(llama, pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port) as llm:
            assert llm.engine.runner.workers.processes == []  # no rank of this host but rank 0
            outputs = llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens[:4]])
            assert [o.token_ids for o in outputs] == expected[:4]
            os.kill(remote.pid, signal.SIGKILL)
            with pytest.raises(RankFailed, match=r"parallel ranks: a collective failed"):
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
            # found by the closed socket, not by the step watchdog (which would end this process)
            assert not llm.engine.runner.workers.watchdog.fired
    finally:
        remote.kill()
        remote.wait(10)


def test_a_rank_of_another_host_stops_with_rank_0_and_refuses_a_rank_out_of_range(llama):
    port = free_port()
    wrong, remote = start_remote_rank(port, 5), start_remote_rank(port, 1)
    try:
        with LLM(llama, pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert remote.wait(RANK_EXIT_BOUND_S) == 0  # told to stop by rank 0's close()
        assert wrong.wait(RANK_EXIT_BOUND_S) != 0
        assert "--rank must be in [1, 1] for this group (rank 0's host runs ranks 0..0), got 5" in wrong.stderr.read()
    finally:
        for process in (wrong, remote):
            process.kill()
            process.wait(10)
