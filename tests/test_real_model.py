"""The default model, SmolLM2-135M-Instruct (from the local GGUF-converted cache), decodes
greedily exactly like transformers' own ``generate`` on the same token ids, in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.models.loader import resolve_model_dir

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short list of three fruits:\n1.",
    "Water boils at a temperature of",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2? Answer with one number."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name a primary color."}],
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
    return LLM("smollm2", dtype="float32", device="cpu", kv_cache_memory="128MiB", seed=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt (EOS from generation_config)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


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
        expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        assert out.prompt_token_ids == list(expected_ids)
        assert out.text.strip()
        check_against_transformers(out, model, tokenizer)
    assert "4" in outs[0].text
