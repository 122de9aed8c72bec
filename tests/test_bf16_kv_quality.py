"""Quality gate of a bfloat16 KV cache under float32 activations (kv_cache_dtype="bfloat16",
what dtype="auto" takes beside the bf16 copy; on any CPU, since the kernels widen bf16 by a
shift) against the float32 cache, on the real SmolLM2: the cache is what decode steps read,
so the gate decodes. Greedy agreement on the first 32 tokens of 16 prompts, reported (run
with -s) and gated: a mean common prefix of at least 24 tokens and at least 10 of the 16
prompts identical for all 32 (the cache's rounding moves each logit by ~1e-3; near ties
flip as with the bf16 copy: tests/test_bf16_quality.py)."""

import pytest
import torch
from test_int8_quality import NUM_PROMPTS, PROMPTS_FROM, TOKENS, greedy_prefixes

from conveyor.engine import LLM

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PROMPTS_FROM.exists(), reason="no Debian licence texts"),
]


def test_bf16_kv_cache_greedy_agreement():
    options = dict(device="cpu", dtype="float32", kv_cache_memory="128MiB", seed=0, max_num_seqs=NUM_PROMPTS)
    bf16_kv = LLM("smollm2", kv_cache_dtype="bfloat16", **options)
    float32 = LLM("smollm2", **options)
    assert (bf16_kv.engine.runner.kv_dtype, float32.engine.runner.kv_dtype) == (torch.bfloat16, torch.float32)
    prefixes = greedy_prefixes(bf16_kv, float32)
    identical = sum(p == TOKENS for p in prefixes)
    assert identical >= 10 and sum(prefixes) / len(prefixes) >= 24
