"""``attention_backend="triton"`` end to end on CPU under Triton's interpreter: greedy output
token-identical to transformers' own generate (float32) for Llama, Qwen2 and Qwen3, with
ample KV, forced preemption, chunked prefill and prefix-cache hits. The interpreter runs
every kernel program as Python, so the workload is small: prompts of 1 to 44 tokens
sharing a 24-token prefix (block boundaries at every 4 or 16), up to 6 new tokens."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
from model_factory import build_tiny_model, hf_greedy, mixed_max_tokens, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402

REGIMES = {
    "ample_kv": dict(num_kv_blocks=64),
    # 13 blocks x 4 tokens: the longest request (44 + 6) just fits alone, the four together
    # don't (no shared prefix blocks to make room)
    "preemption": dict(num_kv_blocks=13, block_size=4, enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=16, num_kv_blocks=64),
    # the first prompt alone, then the others reuse its cached 24-token prefix
    "prefix_cache": dict(block_size=4, num_kv_blocks=80),
}


@pytest.fixture(scope="module", params=("llama", "qwen2", "qwen3"))
def case(request, tmp_path_factory):
    model = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prefix = mixed_prompts(768, n=1, seed=21, min_len=24, max_len=24)[0]
    prompts = [prefix] + [prefix + s for s in mixed_prompts(768, n=2, seed=22, min_len=9, max_len=20)] + [[7]]
    max_tokens = mixed_max_tokens(len(prompts), seed=23, low=2, high=6)
    return model, prompts, max_tokens, [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]


@pytest.mark.parametrize("regime", REGIMES)
def test_triton_backend_greedy_matches_transformers(case, regime):
    model, prompts, max_tokens, expected = case
    llm = LLM(model, attention_backend="triton", **REGIMES[regime])
    assert llm.engine.runner.attention_backend == "triton"
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    if regime == "prefix_cache":
        outputs = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        outputs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, want in zip(outputs, expected):
        assert output.error is None
        assert output.token_ids == want, f"request {output.request_id} differs"
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 if regime == "preemption" else True
    assert stats["num_chunked_prefills"] > 0 if regime == "chunked_prefill" else True
    assert stats["prefix_cache_hit_rate"] > 0.3 if regime == "prefix_cache" else True


def test_backend_choice_and_its_errors(monkeypatch):
    import argparse

    import torch

    from conveyor.actors.cli import _add_engine_options
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.model_runner import resolve_attention_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("auto", cpu) == "torch"  # never the default on CPU
    assert resolve_attention_backend("triton", cpu) == "triton"  # under the interpreter (set above)
    assert resolve_attention_backend("auto", cuda) == "triton"  # the default on CUDA
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="attention_backend='triton' on cpu: .*TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match=r"attention_backend: must be one of \('auto', 'torch', 'triton'\)"):
        EngineConfig(attention_backend="flash")
    monkeypatch.setenv("CONVEYOR_ATTENTION_BACKEND", "triton")
    assert EngineConfig().attention_backend == "triton"
    parser = argparse.ArgumentParser()
    _add_engine_options(parser)
    args = parser.parse_args(["--attention-backend", "triton", "--enforce-eager", "true"])
    assert (args.attention_backend, args.enforce_eager) == ("triton", True)
