"""Quality gate of the int8-activation path (quantization="gguf_int8", and "auto" with
dtype="auto" on a CPU with AVX2 and no AMX: integer dots on GGUF blocks) against our float32
on the real SmolLM2, on a real text. The repacked GEMM (512-bit with AVX512-VNNI, else AVX2)
runs every step, and the row dots, which serve a layer without it, are allowed every row
count here too (prompts scored whole, 16 sequences decoded at once): every number below
comes from int8 activations. llama.cpp's perplexity on the same tokens and GGUF:
benchmarks/peer_perplexity.py (node-llama-cpp is not installed in CI).

- perplexity of the Debian GPL-3 text at most 1% above float32's (the issue's gate), and not
  far below it (at most 2%);
- greedy agreement with float32 on the first 32 tokens of 16 prompts, reported (run with -s)
  and gated loosely: at least 2 of the 16 identical for all 32 tokens and a mean common
  prefix of at least 8. int8 activations move each logit by ~1e-2; on this 135M model a near
  tie then flips a token and the continuations differ legitimately: torch's float32 with its
  activations fake-quantized the same way agrees with float32 on 7 of 16 only, and the int8
  kernels on 2-3 (benchmarks/int8_agreement.py). A wrong scale or stride gives prefixes of 0-1;
- the tokens do not depend on the batch: 16 prompts decoded together equal each decoded
  alone, token for token (every row is quantized and summed on its own, in the same order at
  every row count).
"""

import math
from pathlib import Path

import pytest
from chat_questions import chat_prompts

from conveyor.engine import LLM, SamplingParams

LICENCE = Path("/usr/share/common-licenses/GPL-3")
PROMPTS_FROM = Path("/usr/share/common-licenses/Apache-2.0")
CHUNK, CHUNKS, TOKENS, NUM_PROMPTS = 512, 2, 32, 16

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not LICENCE.exists() or not PROMPTS_FROM.exists(), reason="no Debian licence texts"),
]


@pytest.fixture(scope="module")
def engines():
    from conveyor.kernels.cpu import dispatch
    from conveyor.kernels.cpu.linear import CpuLinear

    options = dict(dtype="float32", device="cpu", kv_cache_memory="128MiB", seed=0, max_num_seqs=NUM_PROMPTS)
    default_rows = dispatch.INT8_MAX_ROWS
    dispatch.set_int8_max_rows(1 << 30)
    try:
        int8 = LLM("smollm2", quantization="gguf_int8", **options)
        assert any(isinstance(m, CpuLinear) and m.activations == "int8" for m in int8.engine.runner.model.modules())
        yield int8, LLM("smollm2", quantization="none", **options)
    finally:
        dispatch.set_int8_max_rows(default_rows)


def perplexity(llm, chunks) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    logprobs = [
        entry[token].logprob for o, c in zip(outputs, chunks) for entry, token in zip(o.prompt_logprobs[1:], c[1:])
    ]
    return math.exp(-sum(logprobs) / len(logprobs))


def prompts() -> list[str]:
    lines = [line.strip() for line in PROMPTS_FROM.read_text().splitlines() if len(line.strip()) > 40]
    return lines[:NUM_PROMPTS]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def perplexity_ratio(llm, float32, name: str) -> float:
    """``llm``'s perplexity on the GPL-3 chunks over float32's, printed (run with -s)."""
    ids = float32.get_tokenizer().encode(LICENCE.read_text())
    chunks = [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)]
    ppl, ppl_float32 = perplexity(llm, chunks), perplexity(float32, chunks)
    print(
        f"\nGPL-3, {CHUNKS} x {CHUNK} tokens: perplexity {name} {ppl:.4f} vs float32 {ppl_float32:.4f}"
        f" ({100 * (ppl / ppl_float32 - 1):+.2f}%)"
    )
    return ppl / ppl_float32


def greedy_prefixes(llm, float32) -> list[int]:
    """Common prefix with float32 of each prompt's first TOKENS greedy tokens, printed."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    texts = prompts()
    ours = [o.token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    reference = [o.token_ids for o in float32.generate(texts, params, use_tqdm=False)]
    prefixes = [common_prefix(a, b) for a, b in zip(ours, reference)]
    identical = sum(p == TOKENS for p in prefixes)
    print(f"\ngreedy, {len(texts)} prompts x {TOKENS} tokens: {identical} identical, common prefixes {prefixes}")
    return prefixes


def test_int8_activations_keep_perplexity_within_one_percent(engines):
    """Within 1% of float32's, either way (far below would mean other numbers, not better
    ones). Measured: +0.09% (AVX512-VNNI EPYC), -0.19% (AVX2 EPYC), -0.04% (a Xeon with AMX,
    5 of 16 greedy answers identical, since prefill attention reads the cache as stored; the
    SDPA prefill over float32 keys gave -1.12% there)."""
    int8, float32 = engines
    assert abs(perplexity_ratio(int8, float32, "int8") - 1) < 0.01


def test_int8_activations_keep_greedy_tokens(engines):
    int8, float32 = engines
    prefixes = greedy_prefixes(int8, float32)
    identical = sum(p == TOKENS for p in prefixes)
    assert identical >= 2 and sum(prefixes) / len(prefixes) >= 8


def test_int8_tokens_do_not_depend_on_the_batch(engines):
    from conveyor.kernels.cpu import dispatch

    int8, _ = engines
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    texts = prompts()
    together = [o.token_ids for o in int8.generate(texts, params, use_tqdm=False)]
    alone = [int8.generate([t], params, use_tqdm=False)[0].token_ids for t in texts]
    assert dispatch.gguf_linear_path(dispatch.cpu_flags(), 1, "int8").startswith("int8:")
    # one sequence decodes in the compiled decoder, 16 on the layers: the same kernels
    assert int8.engine.runner.backend.decoder, "the compiled decoder should serve int8 decode steps"
    assert together == alone


def test_int8_chat_answers_agree_with_float32(engines):
    """What users see: 16 chat questions through the chat template (tests/chat_questions.py),
    32 greedy tokens. Measured on a Xeon with AMX: int8 5 of 16 identical to float32 (mean
    common prefix 19.3), llama.cpp on the same GGUF 5 of 16 (20.4), same run. The floor here
    leaves room for other CPUs' float32 summation orders."""
    int8, float32 = engines
    chats = [{"prompt_token_ids": ids} for ids in chat_prompts(float32.get_tokenizer())]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    ours, want = ([o.token_ids for o in llm.generate(chats, params, use_tqdm=False)] for llm in (int8, float32))
    prefixes = [common_prefix(a, b) for a, b in zip(ours, want)]
    print(f"\nchat, 16 questions x {TOKENS} tokens: {sum(p == TOKENS for p in prefixes)} identical, {prefixes}")
    assert sum(p == TOKENS for p in prefixes) >= 3 and sum(prefixes) / len(prefixes) >= 12


def test_int8_weights_are_held_once(engines):
    """Every projection the repacked GEMM serves keeps only that copy (its GGUF blocks are
    released: shape and dtype on the meta device), in huge-page arenas where the kernel
    allows; the tied head's blocks stay (they are the embedding table too)."""
    from conveyor.kernels.cpu.linear import CpuLinear

    int8, _ = engines
    model = int8.engine.runner.model
    repacked = [m for m in model.modules() if isinstance(m, CpuLinear) and m.int8_gemm is not None]
    projections = [m for m in repacked if m.owns_weight]
    assert len(projections) == 4 * len(model.model.layers)  # qkv, o, gate_up, down
    assert all(m.weight.is_meta and m.fast_path[0] is m.weight for m in projections)
    assert not model.lm_head.owns_weight and not model.lm_head.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight
