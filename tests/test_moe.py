"""Mixture-of-experts models (engine/models/moe.py): tiny random Mixtral, Qwen2-MoE (shared
expert, q/k/v bias) and Qwen3-MoE (q/k norm, renormalized top-k), built at test time, give
greedy ids identical to transformers' own generate in float32, with ample KV, under forced
preemption, with chunked prefill and with n-gram speculation (where a regular expression
also holds on sampled text); the same with expert parallel over two gloo ranks; LoRA
adapters on the attention projections equal transformers + peft's merged model."""

import pytest
from model_factory import MOE_ARCHS, build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.moe import SparseMoe

NUM_PROMPTS = 8
REGIMES = {
    "ample_kv": {},
    "preemption": dict(num_kv_blocks=50, block_size=4),  # 200 slots: the longest (160 + 32) fits alone
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
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
    if regime == "speculative":
        assert stats["spec_decode_num_draft_tokens"] > 0
        check_structured_output(llm)


def check_structured_output(llm) -> None:
    """A regular expression holds on a MoE model's sampled text (the grammar masks the logits)."""
    import re

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs={"regex": "[a-e]{3,6}"})
    [output] = llm.generate(["x"], params, use_tqdm=False)
    assert re.fullmatch("[a-e]{3,6}", output.text), output.text


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


def test_lora_on_the_attention_projections_equals_peft_merged(tmp_path):
    """Adapters on q/k/v/o of a MoE model (Qwen2-MoE: attention biases, a shared expert) equal
    transformers + peft's merged model; one that targets the experts' projections fails alone,
    naming the module."""
    import torch
    from lora_adapter import make_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conveyor.engine import LoRARequest

    model_dir = build_tiny_model("qwen2_moe", tmp_path / "model")
    adapter = make_adapter(model_dir, tmp_path / "attn", 1, ["q_proj", "k_proj", "v_proj", "o_proj"], 4)
    experts = make_adapter(model_dir, tmp_path / "experts", 2, ["q_proj", "gate_proj"], 4)
    prompts = mixed_prompts(768, n=3, seed=4, min_len=3, max_len=40)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).merge_and_unload()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(temperature=0, max_tokens=10)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("attn", 1, adapter))
    assert [o.token_ids for o in outputs] == expected
    assert expected != [hf_greedy(model_dir, p, 10) for p in prompts]  # the adapter does change the output
    bad, good = llm.generate(
        prompts[:2], params, use_tqdm=False, lora_request=[LoRARequest("experts", 2, experts), None]
    )
    assert bad.outputs[0].finish_reason == "error"
    assert "target module 'gate_proj' is not supported on this mixture-of-experts model" in bad.error
    assert good.token_ids == hf_greedy(model_dir, prompts[1], 10)


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
