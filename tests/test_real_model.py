"""The default model, SmolLM2-135M-Instruct (from the local GGUF-converted cache), decodes
greedily exactly like transformers' own ``generate`` on the same token ids, in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.loader import resolve_model_dir

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
PLAIN = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a short list of three fruits:\n1.",
    "Water boils at a temperature of",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2? Answer with one number."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a primary color."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """On this shared 2-core box two intra-op threads contend badly (measured for 4 x 40
    tokens: engine 2.4 s with one thread, 49 s with two; transformers 1.8 s vs 7.1 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir("smollm2")


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_memory="128MiB", seed=0, quantization="gguf")


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt (EOS from generation_config)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def check_against_transformers(out, model, tokenizer):
    expected = hf_greedy(model, out.prompt_token_ids, MAX_TOKENS)
    assert out.token_ids == expected, (tokenizer.decode(out.token_ids), tokenizer.decode(expected))
    if len(expected) < MAX_TOKENS:  # transformers stopped on EOS
        assert out.finish_reason == "stop" and expected[-1] in (tokenizer.eos_token_id, 2)
    else:
        assert out.finish_reason == "length"
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_plain_prompts_match_transformers_greedy(llm, hf):
    model, tokenizer = hf
    outs = llm.generate(PLAIN, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, out in zip(PLAIN, outs):
        assert out.error is None
        assert out.prompt_token_ids == tokenizer.encode(prompt)
        check_against_transformers(out, model, tokenizer)
    assert "Paris" in outs[0].text  # a real model, really loaded


def test_chat_matches_transformers_greedy(llm, hf):
    model, tokenizer = hf
    outs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for messages, out in zip(CHATS, outs):
        assert out.error is None
        expected_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.prompt_token_ids == list(expected_ids)
        assert out.text.strip()
        check_against_transformers(out, model, tokenizer)
    assert "4" in outs[0].text


def test_gguf_blocks_are_kept_and_hold_each_weight_once(llm):
    """quantization="gguf" runs the model's Q4_1/Q8_0 tensors as GGUF blocks,
    with the tied head and the embedding sharing one Q8_0 table, and no float32 copies."""
    from conveyor.kernels.cpu.linear import CpuLinear

    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert len(linears) == 30 * 4 + 1 and all(m.weight.dtype in (torch.uint8, torch.int8) for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(m.fast_path[2] is None for m in linears), "no oneDNN float32 copy of a packed weight"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes < 120 * 2**20, weight_bytes  # 4.5-6 bits a weight, vs 513 MiB in float32


def test_greedy_is_identical_with_gguf_blocks_and_dequantized(llm):
    """quantization="none" dequantizes the same blocks to float32 (the path before): the same
    weights, summed in another order, give the same greedy tokens."""
    dequantized = LLM("smollm2", dtype="float32", device="cpu", kv_cache_memory="64MiB", seed=0, quantization="none")
    assert dequantized.engine.runner.model.model.embed_tokens.weight.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = PLAIN[:3]
    native = llm.generate(prompts, params, use_tqdm=False)
    plain = dequantized.generate(prompts, params, use_tqdm=False)
    for a, b in zip(native, plain):
        assert a.token_ids == b.token_ids, (a.text, b.text)
    single = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:2]]  # compiled decoder steps
    assert [o.token_ids for o in single] == [o.token_ids for o in native[:2]]


DOCUMENT = (
    "The harbour town of Kessel Bay depends on three things: the ferry, the fish market and the "
    "lighthouse. The ferry crosses to the mainland four times a day in summer and twice a day in "
    "winter. The fish market opens at five in the morning and closes at noon, and most of its catch "
    "is sold to restaurants on the mainland. The lighthouse was built in 1872, was automated in 1961 "
    "and now houses a small museum about the history of the harbour. In 2019 the town council voted "
    "to replace the old ferry with an electric one, which began service in the spring of 2022 and "
    "cut the cost of a crossing by a third."
)


def test_speculative_decoding_matches_transformers_greedy(llm, hf):
    """Prompt-lookup drafts on a summarization prompt (the summary copies the document's
    phrases): token-identical to transformers and to the engine without drafts, and drafts
    are accepted."""
    model, tokenizer = hf
    spec = LLM(
        "smollm2",
        dtype="float32",
        device="cpu",
        kv_cache_memory="128MiB",
        seed=0,
        quantization="gguf",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    )
    chats = [
        [{"role": "user", "content": f"Summarize this text in three sentences.\n\n{DOCUMENT}"}],
        [{"role": "user", "content": f"{DOCUMENT}\n\nWhen was the lighthouse built, and what is in it now?"}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = spec.chat(chats, params, use_tqdm=False)
    for out, plain in zip(outs, llm.chat(chats, params, use_tqdm=False)):
        assert out.token_ids == plain.token_ids and out.text == plain.text
        check_against_transformers(out, model, tokenizer)
    stats = spec.engine.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.2, stats
