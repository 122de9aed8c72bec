"""LoRA adapters per request, offline (engine/lora/): PEFT adapters made at test time on a
tiny Llama; greedy output with an adapter equals transformers + peft's merged model token
for token; a batch mixing two adapters and the base model (the same prompt, so the prefix
cache must tell them apart) equals each run alone; with one slot the adapters take turns."""

from __future__ import annotations

import pytest
import torch
from lora_adapter import make_adapter
from model_factory import build_tiny_model

PROMPTS = ["def main():", "import os\n", "class Parser(object):\n    def"]
MAX_TOKENS = 12


def merged_greedy(model_dir: str, adapter_dir: str | None, tokenizer) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conveyor.engine import LLM, LoRARequest

    root = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny_model("llama", root / "model")
    adapters = {
        "a": make_adapter(model_dir, root / "a", 1, ["q_proj", "k_proj", "v_proj", "o_proj"], 4),
        "b": make_adapter(model_dir, root / "b", 2, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 8),
    }
    torch.set_num_threads(1)
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    requests = {"a": LoRARequest("a", 1, adapters["a"]), "b": LoRARequest("b", 2, adapters["b"]), None: None}
    yield model_dir, adapters, llm, requests


def greedy(llm, lora, prompts=PROMPTS):
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]


def test_adapters_equal_transformers_with_peft_merged(setup):
    model_dir, adapters, llm, requests = setup
    for name in ("a", "b", None):
        expected = merged_greedy(model_dir, adapters.get(name), llm.tokenizer)
        assert greedy(llm, requests[name]) == expected, name
    assert greedy(llm, requests["a"]) != greedy(llm, None)  # the adapter does change the output


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(setup):
    _, _, llm, requests = setup
    alone = {name: greedy(llm, requests[name], PROMPTS[:1])[0] for name in ("a", "b", None)}
    order = ["a", None, "b", "b", None, "a"]
    mixed = greedy(llm, [requests[name] for name in order], PROMPTS[:1] * len(order))
    assert mixed == [alone[name] for name in order]
    assert len(set(map(tuple, alone.values()))) == 3


def test_one_slot_serves_two_adapters_in_turn(setup):
    from conveyor.engine import LLM

    model_dir, _, llm, requests = setup
    expected = greedy(llm, [requests["a"], requests["b"], requests["a"]], PROMPTS)
    single = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    assert greedy(single, [requests["a"], requests["b"], requests["a"]], PROMPTS) == expected
    assert single.engine.runner.lora.loads >= 2  # loaded from disk again after its slot was taken


def test_bad_adapter_requests_fail_alone(setup, tmp_path):
    from conveyor.engine import LLM, LoRARequest, SamplingParams

    model_dir, adapters, llm, requests = setup
    params = SamplingParams(temperature=0.0, max_tokens=2)
    missing = LoRARequest("gone", 7, str(tmp_path / "nothing"))
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=[missing, None])
    assert outputs[0].outputs[0].finish_reason == "error" and "adapter_config.json" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"
    wide = make_adapter(model_dir, tmp_path / "wide", 4, ["q_proj"], 16)  # rank 16 > max_lora_rank 8
    [out] = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=LoRARequest("wide", 9, wide))
    assert out.outputs[0].finish_reason == "error" and "max_lora_rank" in out.error
    plain = LLM(model_dir)
    [out] = plain.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=requests["a"])
    assert "enable_lora" in out.error


def test_an_adapter_on_a_bf16_product_adds_a_float_delta():
    """Behind a bf16 copy (dtype=auto on bf16 hardware) a projection's x and product may be
    bfloat16 (kernels/cpu/linear.py ``bf16_output``): the adapter's delta is computed from x
    widened to the adapter's float32 and added into the product."""
    from conveyor.engine.lora.layers import LoRABatch, LoRALinear

    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(16, 8, bias=False)
    batch = LoRABatch(runs=[(0, 0, 3)])
    lora = LoRALinear(base, [("o_proj", 0, 8)], 16, 1, 4, batch, torch.float32, torch.device("cpu"))
    a, b = torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    lora.set_slot(0, {"o_proj": (a, b)})
    base.to(torch.bfloat16)  # a bf16 layer stands in for the bf16 copy: bf16 in, bf16 out
    x = torch.randn(5, 16, generator=gen).bfloat16()
    out = lora(x)
    expected = base(x).float()
    expected[:3] += x[:3].float() @ a.T @ b.T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=2**-7)
