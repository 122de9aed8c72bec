"""Conveyor's offline API as a drop-in for vLLM's: the names a script written for
``from vllm import LLM, SamplingParams`` uses, and the behaviours it relies on.

The names below are vLLM's own, copied from its source (vllm/outputs.py, vllm/logprobs.py,
vllm/sampling_params.py, vllm/entrypoints/llm.py of vllm-project/vllm, the snapshot read
for this work), not derived from Conveyor's code. Everything runs on a tiny random Llama
(tests/model_factory.py).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_factory, however pytest is run

from model_factory import VOCAB_SIZE, build_tiny_model, build_tokenizer, mixed_prompts  # noqa: E402

from conveyor.engine import LLM, ModelLoadError, SamplingParams  # noqa: E402
from conveyor.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from conveyor.engine.vllm_options import kv_budget_from_utilization  # noqa: E402

# vllm/outputs.py: CompletionOutput's dataclass fields and RequestOutput.__init__'s arguments
VLLM_COMPLETION_OUTPUT_FIELDS = (
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "finish_reason",
    "stop_reason",
)
VLLM_REQUEST_OUTPUT_FIELDS = (
    "request_id",
    "prompt",
    "prompt_token_ids",
    "prompt_logprobs",
    "outputs",
    "finished",
    "metrics",
    "num_cached_tokens",
)
# vllm/logprobs.py
VLLM_LOGPROB_FIELDS = ("logprob", "rank", "decoded_token")
# vllm/sampling_params.py: SamplingParams fields a script passes (and their defaults)
VLLM_SAMPLING_DEFAULTS = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "logit_bias": None,
}
# vllm/entrypoints/llm.py: LLM.__init__ keywords (EngineArgs for the last five)
VLLM_LLM_OPTIONS = (
    "tokenizer",
    "trust_remote_code",
    "tensor_parallel_size",
    "dtype",
    "quantization",
    "seed",
    "gpu_memory_utilization",
    "swap_space",
    "enforce_eager",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_prefix_caching",
)
# vllm/inputs: TextPrompt and TokensPrompt keys
VLLM_TEXT_PROMPT_KEY, VLLM_TOKENS_PROMPT_KEY = "prompt", "prompt_token_ids"

KV_BYTES = 64 * 2**20

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("dropin_llama"))


def vllm_style_options(model_dir) -> dict:
    """What a vLLM script passes (every name of VLLM_LLM_OPTIONS, vLLM's value spellings)."""
    return dict(
        tokenizer=model_dir,
        trust_remote_code=False,
        tensor_parallel_size=1,
        dtype="float",
        quantization=None,
        seed=0,
        gpu_memory_utilization=0.9,
        swap_space=4,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        block_size=16,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=KV_BYTES,
    )


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **vllm_style_options(model_dir))


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(VOCAB_SIZE, n=6, seed=21, min_len=5, max_len=30)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# --------------------------------------------------------------------------- names


def test_output_objects_have_vllms_fields(llm, prompts):
    out = llm.generate(prompts[0], greedy(4, logprobs=1), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert all(hasattr(out, name) for name in VLLM_REQUEST_OUTPUT_FIELDS)
    assert set(VLLM_COMPLETION_OUTPUT_FIELDS) <= {f.name for f in dataclasses.fields(CompletionOutput)}
    assert tuple(f.name for f in dataclasses.fields(Logprob)) == VLLM_LOGPROB_FIELDS
    completion = out.outputs[0]
    assert completion.index == 0 and completion.finished() and completion.finish_reason == "length"
    assert len(completion.token_ids) == 4 and completion.text == out.text  # the n=1 shortcut
    assert out.finished and out.metrics.num_output_tokens == 4 and out.num_cached_tokens == 0
    assert out.prompt is None and out.prompt_token_ids == prompts[0] and out.prompt_logprobs is None
    assert all(isinstance(lp, Logprob) for position in completion.logprobs for lp in position.values())


def test_sampling_params_take_vllms_names_and_defaults():
    params = SamplingParams()
    assert {name: getattr(params, name) for name in VLLM_SAMPLING_DEFAULTS} == VLLM_SAMPLING_DEFAULTS
    assert SamplingParams(**VLLM_SAMPLING_DEFAULTS).n == 1


def test_llm_takes_vllms_options_and_refuses_with_a_reason(llm, model_dir):
    assert set(VLLM_LLM_OPTIONS) <= set(vllm_style_options(model_dir))  # the fixture took them all
    config = llm.llm_engine.config
    assert config.gpu_memory_utilization == 0.9 and config.dtype == "float32" and config.quantization == "auto"
    assert config.kv_cache_memory == KV_BYTES and config.tokenizer == model_dir and config.max_model_len == 512
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().decode([5])
    with pytest.raises(ValueError, match=r"trust_remote_code=True: .*never runs code"):
        LLM(model_dir, trust_remote_code=True)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3: .*num_attention_heads \(4\)"):
        LLM(model_dir, tensor_parallel_size=3)  # TP=2 itself: tests/test_tensor_parallel.py
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        LLM(model_dir, gpu_memory_utilization=1.5)
    with pytest.raises(ModelLoadError, match="tokenizer: .* is not a local directory"):
        LLM(model_dir, tokenizer="no/such/tokenizer", kv_cache_memory=KV_BYTES)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(model_dir, no_such_option=1)


def test_gpu_memory_utilization_leaves_the_kv_cache_what_remains_of_the_fraction():
    gib = 2**30
    assert kv_budget_from_utilization(0.9, 100 * gib, 80 * gib) == 70 * gib  # 20 GiB in use already
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1: 20% of the device is already in use"):
        kv_budget_from_utilization(0.1, 100 * gib, 80 * gib)


def test_a_separate_tokenizer_directory_is_used(model_dir, tmp_path):
    build_tokenizer(tmp_path)  # the same tokenizer, saved alone
    llm = LLM(model_dir, tokenizer=str(tmp_path), kv_cache_memory_bytes=KV_BYTES)
    assert llm.llm_engine.tokenizer_dir == tmp_path
    assert llm.generate("def main():", greedy(3), use_tqdm=False)[0].outputs[0].text


# --------------------------------------------------------------------------- prompts


def test_vllms_prompt_dicts_are_accepted(llm, prompts):
    plain_text, plain_ids = llm.generate(["def main():", prompts[1]], greedy(5), use_tqdm=False)
    as_dicts = llm.generate(
        [{VLLM_TEXT_PROMPT_KEY: "def main():"}, {VLLM_TOKENS_PROMPT_KEY: prompts[1]}], greedy(5), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in as_dicts] == [plain_text.token_ids, plain_ids.token_ids]
    assert as_dicts[0].prompt == plain_text.prompt == "def main():" and as_dicts[1].prompt is None
    single = llm.generate({VLLM_TOKENS_PROMPT_KEY: prompts[1]}, greedy(5), use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == plain_ids.token_ids
    bad, good = llm.generate([{"prompt": "x", "multi_modal_data": {}}, "def f():"], greedy(2), use_tqdm=False)
    assert bad.finish_reason == "error" and "multi_modal_data" in bad.error and good.finish_reason == "length"


def test_invalid_parameters_fail_their_own_request_not_the_batch(llm, prompts):
    """A deliberate difference from vLLM (which raises): the rest of the batch still runs."""
    params = [
        greedy(3),
        greedy(3, logit_bias={1: 101.0}),
        greedy(3, logit_bias={VOCAB_SIZE: 1.0}),
        greedy(3, prompt_logprobs=21),
        greedy(3),
    ]
    outs = llm.generate([prompts[0]] * len(params), params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "logit_bias[1]: must be <= 100.0, got 101.0" in outs[1].error
    assert f"logit_bias: keys must be token ids (ints in [0, {VOCAB_SIZE}))" in outs[2].error
    assert "prompt_logprobs: must be <= 20" in outs[3].error
    assert outs[1].outputs[0].token_ids == [] and outs[1].finished


# --------------------------------------------------------------------------- stops


def ascii_reference(llm, prompts, length=24):
    """A greedy continuation and a position k whose token decodes to ASCII text and has not
    appeared before it (so a stop on that token id stops exactly there)."""
    tokenizer = llm.get_tokenizer()
    for prompt in prompts:
        ref = llm.generate([prompt], greedy(length), use_tqdm=False)[0].token_ids
        for k in range(2, length - 2):
            text = tokenizer.decode(ref[: k + 1])
            if ref[k] not in ref[:k] and text.isascii() and tokenizer.decode([ref[k]]).strip():
                return prompt, ref, k
    pytest.skip("no usable stop token in the reference continuations")


def test_stop_token_text_is_left_out_unless_asked(llm, prompts):
    tokenizer = llm.get_tokenizer()
    prompt, ref, k = ascii_reference(llm, prompts)
    out = llm.generate([prompt], greedy(24, stop_token_ids=[ref[k]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: k + 1]  # the stop token stays in token_ids ...
    assert out.text == tokenizer.decode(ref[:k])  # ... but not in the text (vLLM's detokenizer)
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[k])
    kept = llm.generate([prompt], greedy(24, stop_token_ids=[ref[k]], include_stop_str_in_output=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert kept.token_ids == ref[: k + 1] and kept.text == tokenizer.decode(ref[: k + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(llm, prompts):
    prompt, ref, k = ascii_reference(llm, prompts)
    full = llm.get_tokenizer().decode(ref)
    stop = full[len(llm.get_tokenizer().decode(ref[:k])) :][:2]  # text that first shows up at token k
    cut = llm.generate([prompt], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    kept = llm.generate([prompt], greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == cut.text + stop and full.startswith(kept.text) and stop not in cut.text
    assert kept.stop_reason == cut.stop_reason == stop


def test_spaces_between_special_tokens_reaches_the_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    specials = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    bias = {token_id: 100.0 for token_id in specials}
    for spaces in (True, False):
        out = llm.generate(
            "def f():",
            greedy(4, logit_bias=bias, skip_special_tokens=False, spaces_between_special_tokens=spaces),
            use_tqdm=False,
        )[0]
        assert set(out.token_ids) <= set(specials)
        assert out.text == tokenizer.decode(
            out.token_ids, skip_special_tokens=False, spaces_between_special_tokens=spaces
        )


# --------------------------------------------------------------------------- logprobs, bias


def test_logit_bias_moves_the_choice(llm, prompts):
    base = llm.generate([prompts[2]], greedy(6), use_tqdm=False)[0].token_ids
    target = next(t for t in range(10, VOCAB_SIZE) if t not in base)
    pushed = llm.generate([prompts[2]], greedy(6, logit_bias={target: 100.0}), use_tqdm=False)[0]
    assert pushed.token_ids == [target] * 6
    banned = llm.generate([prompts[2]], greedy(6, logit_bias={base[0]: -100.0}), use_tqdm=False)[0]
    assert banned.token_ids[0] != base[0]


def test_prompt_logprobs_score_every_prompt_token_like_transformers(llm, model_dir, prompts):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = prompts[3]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    # twice: the second run finds the prompt's blocks cached but must compute them again
    for _ in range(2):
        out = llm.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            token, row = prompt[position], ref[position - 1]
            assert list(entry)[0] == token and len(entry) in (2, 3)
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry[token].rank == int((row >= row[token]).sum())
            assert {1, 2} <= {lp.rank for lp in entry.values()}  # the top two
        assert out.num_cached_tokens == 0


def test_prompt_logprobs_survive_chunked_prefill(model_dir, prompts):
    chunked = LLM(model_dir, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=8)
    whole = LLM(model_dir, kv_cache_memory_bytes=KV_BYTES)
    params = greedy(2, prompt_logprobs=0)
    a, b = (engine.generate([prompts[1]], params, use_tqdm=False)[0] for engine in (chunked, whole))
    assert len(a.prompt_logprobs) == len(prompts[1])
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert list(x) == list(y) and [v.logprob for v in x.values()] == pytest.approx(
            [v.logprob for v in y.values()], abs=1e-4
        )
