"""Greedy output must be token-identical to transformers' own generate (each prompt alone,
float32) for every supported architecture, under every scheduling regime."""

import pytest
from model_factory import ARCHS, build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.decoder_layout import decoder_layout

NUM_PROMPTS = 12
REGIMES = {
    "ample_kv": {},
    # 64 blocks x 4 tokens = 256 slots: the longest request (200 + 40) fits alone, 12 don't
    "preemption": dict(num_kv_blocks=64, block_size=4),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "dynamic_batching": dict(batching="dynamic", max_batch_size=5, batch_window_ms=5),
    # step N+1 planned while N runs (the replica's overlapped steps), alone and with the others
    "overlapped": dict(async_scheduling=True),
    "overlapped_preemption": dict(async_scheduling=True, num_kv_blocks=64, block_size=4),
    "overlapped_chunked_prefill": dict(async_scheduling=True, max_num_batched_tokens=16),
    # prompt-lookup drafts verified in one step (tests/test_spec_decode.py: accepted runs, stops, sampling)
    "speculative": dict(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    ),
}


@pytest.fixture(scope="module", params=ARCHS)
def tiny_model(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def workload(tiny_model):
    prompts = mixed_prompts(768, n=NUM_PROMPTS, seed=1, min_len=1, max_len=200)
    max_tokens = mixed_max_tokens(NUM_PROMPTS, seed=1, low=1, high=40)
    expected = [hf_greedy(tiny_model, p, n) for p, n in zip(prompts, max_tokens)]
    return prompts, max_tokens, expected


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_matches_transformers(tiny_model, workload, regime):
    prompts, max_tokens, expected = workload
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) >= 190
    llm = LLM(tiny_model, **REGIMES[regime])
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.error is None
        assert output.token_ids == want, f"request {output.request_id} differs"
    stats = llm.engine.stats()
    if regime.endswith("preemption"):
        assert stats["num_preemptions"] > 0
    if regime.endswith("chunked_prefill"):
        assert stats["num_chunked_prefills"] > 0
    if regime == "speculative":
        assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


def test_ignore_eos_runs_to_max_tokens(tiny_model, workload):
    prompts, max_tokens, _ = workload
    llm = LLM(tiny_model)
    outputs = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(tiny_model, prompt, 30, ignore_eos=True)
        assert output.finish_reason == "length" and len(output.token_ids) == 30


def test_single_stream_decode_matches_transformers(tiny_model, workload):
    """One request at a time: every decode step is a single token, which on CPU runs the
    compiled whole-model decoder for the Llama family (except Qwen3's q/k norms)."""
    prompts, _, _ = workload
    llm = LLM(tiny_model)
    for prompt in prompts[:3]:
        output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), use_tqdm=False)[
            0
        ]
        assert output.token_ids == hf_greedy(tiny_model, prompt, 25, ignore_eos=True)
    runner = llm.engine.runner
    if decoder_layout(runner.model) is not None:
        assert runner.backend.decoder, "the compiled decoder should have served these steps"


def test_sharded_checkpoint_loads(tmp_path):
    import transformers

    source = build_tiny_model("llama", tmp_path / "whole")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    prompt = mixed_prompts(768, n=1, seed=3, min_len=20, max_len=20)[0]
    output = LLM(str(tmp_path / "sharded")).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert output.token_ids == hf_greedy(source, prompt, 12)


@pytest.mark.parametrize(
    "options", [dict(block_size=4), dict(block_size=4, num_kv_blocks=90)], ids=["ample_kv", "preemption"]
)
def test_prefix_cache_hits_keep_outputs_exact(tiny_model, options):
    """Prompts sharing a long instruction prefix reuse its cached blocks, also after preemption."""
    prefix = mixed_prompts(768, n=1, seed=11, min_len=70, max_len=70)[0]
    suffixes = mixed_prompts(768, n=8, seed=12, min_len=1, max_len=40)
    prompts = [prefix] + [prefix + s for s in suffixes] + [prefix[:50]]
    llm = LLM(tiny_model, **options)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate(prompts[:1], params, use_tqdm=False)  # warms the cache with the prefix
    outputs = first + llm.generate(prompts[1:], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(tiny_model, prompt, 12)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_rate"] > 0.5
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_prefix_caching_can_be_switched_off(tiny_model):
    prompt = mixed_prompts(768, n=1, seed=13, min_len=64, max_len=64)[0]
    llm = LLM(tiny_model, enable_prefix_caching=False)
    llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hit_rate"] == 0.0
