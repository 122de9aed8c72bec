"""Mixture-of-experts models (engine/models/moe.py): tiny random Mixtral, Qwen2-MoE (shared
expert, q/k/v bias) and Qwen3-MoE (q/k norm, renormalized top-k), built at test time, give
greedy ids identical to transformers' own generate in float32, with ample KV, under forced
preemption and with chunked prefill; and the same with expert parallel over two gloo ranks."""

import pytest
from model_factory import MOE_ARCHS, build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.moe import SparseMoe

NUM_PROMPTS = 8
REGIMES = {
    "ample_kv": {},
    "preemption": dict(num_kv_blocks=50, block_size=4),  # 200 slots: the longest (160 + 32) fits alone
    "chunked_prefill": dict(max_num_batched_tokens=16),
}


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_model(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def workload(moe_model):
    prompts = mixed_prompts(768, n=NUM_PROMPTS, seed=2, min_len=1, max_len=160)
    max_tokens = mixed_max_tokens(NUM_PROMPTS, seed=2, low=1, high=32)
    expected = [hf_greedy(moe_model, p, n) for p, n in zip(prompts, max_tokens)]
    return prompts, max_tokens, expected


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_matches_transformers(moe_model, workload, regime):
    prompts, max_tokens, expected = workload
    llm = LLM(moe_model, **REGIMES[regime])
    layers = llm.engine.runner.model.model.layers
    assert any(isinstance(layer.mlp, SparseMoe) for layer in layers)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.error is None
        assert output.token_ids == want, f"request {output.request_id} differs"
    stats = llm.engine.stats()
    if regime == "preemption":
        assert stats["num_preemptions"] > 0
    if regime == "chunked_prefill":
        assert stats["num_chunked_prefills"] > 0


def test_the_families_route_and_share_as_their_configs_say(tmp_path):
    """Qwen2-MoE's dense layer (mlp_only_layers) stays dense and its sparse ones hold the shared
    expert; Mixtral renormalizes its top-k always, Qwen2-MoE only with norm_topk_prob."""
    qwen2 = LLM(build_tiny_model("qwen2_moe", tmp_path / "q2"), num_kv_blocks=64)
    kinds = [type(layer.mlp).__name__ for layer in qwen2.engine.runner.model.model.layers]
    assert kinds == ["SparseMoe", "LlamaMLP", "SparseMoe"]
    first = qwen2.engine.runner.model.model.layers[0].mlp
    assert first.shared_expert is not None and not first.renormalize and first.top_k == 2
    mixtral = LLM(build_tiny_model("mixtral", tmp_path / "mx"), num_kv_blocks=64)
    assert mixtral.engine.runner.model.model.layers[0].mlp.renormalize


def test_what_is_not_built_for_experts_fails_at_load_naming_the_option(moe_model):
    from conveyor.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="tensor_parallel_size=2: .* pass enable_expert_parallel=True"):
        LLM(moe_model, tensor_parallel_size=2)
    from transformers import AutoConfig

    from conveyor.engine.distributed.shard import check_shardable
    from conveyor.engine.models.llama import LlamaForCausalLM

    config = AutoConfig.from_pretrained(moe_model)
    config.num_experts = config.num_local_experts = 3
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=2: the model's experts \\(3\\) is not a multiple"):
        check_shardable(LlamaForCausalLM, config, 2, "none", expert_parallel=True)
    with pytest.raises(Exception, match="enable_lora: adapters are not served for mixture-of-experts models"):
        LLM(moe_model, enable_lora=True)


@pytest.mark.usefixtures("one_torch_thread")  # each rank one thread: two ranks, two cores
def test_expert_parallel_over_two_ranks_matches_transformers(moe_model, workload):
    """Each rank holds 2 of the 4 experts (and half of Qwen2-MoE's shared expert and dense
    layer), routes every token, and one all-reduce sums the layer's parts."""
    prompts, max_tokens, expected = workload
    llm = LLM(moe_model, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        layers = llm.engine.runner.model.model.layers
        sparse = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoe)]
        assert sparse and all(len(moe.experts) == 2 and moe.first_expert == 0 for moe in sparse)
        params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
    finally:
        llm.close()
