"""Parallel sampling (``SamplingParams(n=...)``) on a tiny random Llama: the prompt is
computed once and its full KV blocks are shared by reference count, seeds follow vLLM
(child i samples with seed + i), outputs come back as ``RequestOutput.outputs[i]``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_factory, however pytest is run

from model_factory import VOCAB_SIZE, build_tiny_model, hf_greedy, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402

KV = "64MiB"
BLOCK = 16
PROMPT_LEN = 40  # two full blocks of 16 and a partial one of 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("parallel_llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_memory=KV, block_size=BLOCK, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(VOCAB_SIZE, n=5, seed=33, min_len=PROMPT_LEN, max_len=PROMPT_LEN)


def sampled(n: int, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_lists(output) -> list[list[int]]:
    return [completion.token_ids for completion in output.outputs]


# --------------------------------------------------------------------------- outputs and seeds


def test_seeded_samples_are_reproducible_and_independent_of_the_batch(llm, prompts):
    alone = llm.generate([prompts[0]], sampled(3, seed=7), use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2] and alone.finished
    assert len({tuple(t) for t in token_lists(alone)}) == 3  # three different samples
    again = llm.generate([prompts[0]], sampled(3, seed=7), use_tqdm=False)[0]
    neighbours = [sampled(2), SamplingParams(temperature=0, max_tokens=5), sampled(1, seed=99)]
    batched = llm.generate(
        [prompts[1], prompts[0], prompts[2], prompts[0]],
        [neighbours[0], sampled(3, seed=7), neighbours[1], neighbours[2]],
        use_tqdm=False,
    )[1]
    assert token_lists(again) == token_lists(batched) == token_lists(alone)
    # vLLM's child seeds: sample i is what n=1 with seed + i gives
    singles = [llm.generate([prompts[0]], sampled(1, seed=7 + i), use_tqdm=False)[0].token_ids for i in range(3)]
    assert singles == token_lists(alone)


def test_unseeded_samples_differ(llm, prompts):
    out = llm.generate([prompts[3]], sampled(4), use_tqdm=False)[0]
    assert len({tuple(t) for t in token_lists(out)}) == 4


def test_greedy_n_gives_n_identical_copies_of_transformers_greedy(llm, model_dir, prompts):
    """vLLM refuses greedy n > 1 (n must be 1 when using greedy sampling); we return the
    n copies OpenAI's API returns."""
    out = llm.generate(
        [prompts[4]], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert token_lists(out) == [hf_greedy(model_dir, prompts[4], 10, ignore_eos=True)] * 3
    assert len({c.text for c in out.outputs}) == 1 and out.metrics.num_output_tokens == 30


def test_one_output_shortcuts_refuse_to_pick_one_of_n(llm, prompts):
    out = llm.generate([prompts[0]], sampled(2, max_tokens=2), use_tqdm=False)[0]
    with pytest.raises(AttributeError, match=r"RequestOutput.text: this request has 2 outputs .*outputs\[i\].text"):
        out.text  # noqa: B018
    assert out.num_output_tokens == 4


def test_n_over_the_limit_fails_that_request_naming_the_field(llm, prompts):
    bad, good = llm.generate([prompts[0]] * 2, [sampled(17), sampled(2, max_tokens=1)], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "n: must be <= 16, got 17" in bad.error
    assert [c.finish_reason for c in good.outputs] == ["length", "length"]


# --------------------------------------------------------------------------- the prompt, once


def run_counting_prompt_tokens(engine, request_id, prompt, params):
    """Drive the engine by its two halves (schedule, execute, postprocess) to the end; counts
    the prompt positions computed, looks at the block tables while all samples run."""
    engine.add_request(request_id, prompt, params)
    computed, shared, outputs = 0, None, []
    while engine.has_unfinished_requests():
        plan = engine.schedule()
        computed += sum(max(0, min(s.num_computed + s.num_new, len(prompt)) - s.num_computed) for s in plan.scheduled)
        outputs += engine.postprocess(plan, engine.runner.execute(plan))
        running = engine.scheduler.running
        if shared is None and len(running) == params.n:
            shared = [s.block_table for s in sorted(running, key=lambda s: s.sample_index)]
            counts = [engine.scheduler.block_manager.ref_counts[b] for b in shared[0]]
    return computed, shared, counts, outputs


def test_the_prompt_is_computed_once_and_its_full_blocks_shared(model_dir, prompts):
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=BLOCK)
    n, full = 4, PROMPT_LEN // BLOCK
    computed, tables, counts, outputs = run_counting_prompt_tokens(
        llm.engine, "r", prompts[1], sampled(n, max_tokens=6, seed=3)
    )
    assert all(table[:full] == tables[0][:full] for table in tables)  # the same physical blocks ...
    assert counts[:full] == [n] * full  # ... referenced by all n samples
    assert len({table[full] for table in tables}) == n  # each its own partial block
    assert computed == PROMPT_LEN + (n - 1) * (PROMPT_LEN - full * BLOCK)  # 40 + 3 * 8, not 4 * 40
    final = outputs[-1]
    assert final.finished and final.request_id == "r" and final.num_cached_tokens == full * BLOCK
    assert [o.finished for o in outputs].count(True) == 1  # one RequestOutput per step, finished once
    assert all(len(o.outputs) == n for o in outputs)


def test_without_prefix_caching_each_sample_computes_the_prompt(model_dir, prompts):
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=BLOCK, enable_prefix_caching=False)
    computed, tables, counts, _ = run_counting_prompt_tokens(
        llm.engine, "r", prompts[1], sampled(3, max_tokens=3, seed=3)
    )
    assert computed == 3 * PROMPT_LEN and counts == [1] * len(counts)


def test_prompt_logprobs_are_scored_by_the_leader_alone(llm, prompts):
    out = llm.generate([prompts[2]], sampled(3, max_tokens=2, seed=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == PROMPT_LEN and out.prompt_logprobs[0] is None
    assert out.num_cached_tokens == (PROMPT_LEN // BLOCK) * BLOCK  # the followers still share the blocks
    single = llm.generate([prompts[2]], sampled(1, max_tokens=2, seed=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert [list(p) for p in out.prompt_logprobs[1:]] == [list(p) for p in single.prompt_logprobs[1:]]


def test_aborting_the_request_aborts_every_sample(model_dir, prompts):
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=BLOCK)
    engine = llm.engine
    engine.add_request("r", prompts[0], sampled(3, max_tokens=50, seed=2))
    engine.add_request("other", prompts[1], sampled(1, max_tokens=10, seed=2))
    for _ in range(3):
        engine.step()
    engine.abort_request("r")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = next(o for o in outputs if o.request_id == "r")  # the very next step reports it
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 3
    assert not engine.scheduler.seqs and engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks
    assert next(o for o in outputs if o.request_id == "other" and o.finished).finish_reason == "length"
