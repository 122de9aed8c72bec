"""The Triton kernels (kernels/triton/) against the torch reference, on CPU tensors under
Triton's interpreter. Tolerances, against the reference computed in float32 from the same
inputs: float32 1e-5; float16 2e-3 and bfloat16 2e-2 (absolute and relative: one or two
roundings of the output to the dtype; the interpreter's float32 -> bfloat16 cast is not
always round-to-nearest, so bfloat16 may differ by an ulp more than a GPU would)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from conveyor.engine.models.llama import rotary_for  # noqa: E402
from conveyor.kernels import layer_ops  # noqa: E402
from conveyor.kernels.attention import paged_decode_attention_reference, prefill_attention, write_kv_cache  # noqa: E402
from conveyor.kernels.sampling import apply_penalties, apply_top_k_top_p_min_p, sample_with_noise  # noqa: E402
from conveyor.kernels.triton import cache_write, decode_attention  # noqa: E402
from conveyor.kernels.triton import layer_ops as triton_ops  # noqa: E402
from conveyor.kernels.triton import prefill_attention as triton_prefill
from conveyor.kernels.triton import sampling as triton_sampling

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16
# every GQA ratio, head size and dtype at least once, in few interpreter runs
SHAPES = [
    (1, 64, torch.float32),
    (2, 128, torch.bfloat16),
    (4, 64, torch.float16),
    (8, 128, torch.float32),
    (4, 128, torch.bfloat16),
    (8, 64, torch.float16),
]


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def paged_cache(lengths, kv_heads, head_dim, dtype, seed=0, num_blocks=24):
    """Random K/V of ``lengths`` tokens in scattered blocks; returns caches, tables, keys, values."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(kv_heads, num_blocks, BLOCK_SIZE, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values = [], [], []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        keys.append(torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype))
        write_kv_cache(keys[-1], values[-1], k_cache, v_cache, slots_of(table, range(length)))
        tables.append(table)
    return k_cache, v_cache, tables, keys, values


def slots_of(table, positions):
    return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions], dtype=torch.long)


def padded(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


@pytest.mark.parametrize("group,head_dim,dtype", SHAPES)
def test_paged_decode_matches_reference(group, head_dim, dtype):
    """Odd lengths, exact block boundaries (16, 32), one token; one split and three (some empty)."""
    lengths, kv_heads = [1, 16, 33, 70], 2
    k_cache, v_cache, tables, _, _ = paged_cache(lengths, kv_heads, head_dim, dtype)
    query = torch.randn(len(lengths), kv_heads * group, head_dim).to(dtype)
    block_tables, context_lens = padded(tables), torch.tensor(lengths)
    want = paged_decode_attention_reference(
        query.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, head_dim**-0.5
    )
    for splits in (1, 3):
        got = decode_attention.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5, num_splits=splits, tile=16
        )
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_decode_of_a_padded_row_is_zero_and_harmless():
    k_cache, v_cache, tables, _, _ = paged_cache([5, 20], 2, 64, torch.float32)
    query = torch.randn(3, 4, 64)
    block_tables = padded(tables + [[0]])
    got = decode_attention.paged_decode_attention(
        query, k_cache, v_cache, block_tables, torch.tensor([5, 20, 0]), 0.125, num_splits=2, tile=16
    )
    want = paged_decode_attention_reference(query[:2], k_cache, v_cache, block_tables[:2], torch.tensor([5, 20]), 0.125)
    assert_close(got[:2], want, torch.float32)
    assert torch.equal(got[2], torch.zeros(4, 64))


def test_split_choice_grows_with_context_and_stays_bounded():
    assert decode_attention.choose_splits(1, 16, 64, tile=32) == 1
    assert decode_attention.choose_splits(256, 16, 2, tile=32) == decode_attention.MAX_SPLITS
    assert 1 < decode_attention.choose_splits(64, 16, 32, tile=32) < decode_attention.MAX_SPLITS


@pytest.mark.parametrize("group,head_dim,dtype", [SHAPES[0], SHAPES[1], SHAPES[5]])
def test_varlen_prefill_over_cached_prefix_matches_reference(group, head_dim, dtype):
    """Three spans in one launch: a whole prompt (no prefix), a chunk after a prefix ending
    mid-block, one after a prefix on a block boundary; causal within the new tokens."""
    kv_heads = 2
    spans = [(0, 21), (13, 19), (32, 5)]  # (prefix_len, new tokens)
    k_cache, v_cache, tables, keys, values = paged_cache([p + n for p, n in spans], kv_heads, head_dim, dtype)
    queries = [torch.randn(n, kv_heads * group, head_dim).to(dtype) for _, n in spans]
    query = torch.cat(queries)
    starts = torch.tensor([0, 21, 40])
    out = torch.zeros_like(query)
    triton_prefill.prefill_attention_varlen(
        query,
        k_cache,
        v_cache,
        out,
        starts,
        torch.tensor([n for _, n in spans]),
        torch.tensor([p for p, _ in spans]),
        padded(tables),
        max(n for _, n in spans),
        head_dim**-0.5,
        block_m=16,
        block_n=16,
    )
    for (prefix, new), start, q, k, v, table in zip(spans, starts.tolist(), queries, keys, values, tables):
        want = prefill_attention(
            q.float(),
            k[prefix:].float(),
            v[prefix:].float(),
            k_cache.float(),
            v_cache.float(),
            torch.tensor(table),
            prefix,
            head_dim**-0.5,
        )
        assert_close(out[start : start + new], want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_write_matches_reference_and_skips_negative_slots(dtype):
    key, value = torch.randn(37, 2, 64).to(dtype), torch.randn(37, 2, 64).to(dtype)
    slots = torch.randperm(24 * BLOCK_SIZE)[:37]
    slots[5] = -1  # padding
    want_k, want_v = torch.zeros(2, 24, BLOCK_SIZE, 64, dtype=dtype), torch.zeros(2, 24, BLOCK_SIZE, 64, dtype=dtype)
    keep = slots >= 0
    write_kv_cache(key[keep], value[keep], want_k, want_v, slots[keep])
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cache_write.write_kv_cache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_and_silu_match_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(19, 96, generator=gen).to(dtype), torch.randn(19, 96, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
    assert_close(triton_ops.rms_norm(x, weight, 1e-5), layer_ops.rms_norm_reference(x, weight, 1e-5), dtype)
    normed, new_residual = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(new_residual, residual + x, dtype)
    assert_close(normed, layer_ops.rms_norm_reference(residual + x, weight, 1e-5), dtype)
    gate_up = torch.randn(19, 2 * 80, generator=gen).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert_close(triton_ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_with_llama3_scaling_matches_reference(dtype):
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    )
    rotary = rotary_for(config, "LlamaForCausalLM", 256)
    positions = torch.tensor([0, 1, 7, 31, 32, 100, 255])
    cos, sin = rotary(positions)
    q, k = torch.randn(7, 4, 64).to(dtype), torch.randn(7, 2, 64).to(dtype)
    want_q, want_k = layer_ops.apply_rotary(q.float(), k.float(), (cos, sin))
    got_q, got_k = q.clone(), k.clone()
    triton_ops.rotary_(got_q, cos.reshape(7, -1), sin.reshape(7, -1))
    triton_ops.rotary_(got_k, cos.reshape(7, -1), sin.reshape(7, -1))
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)


def test_penalties_match_reference():
    gen = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(4, 300, generator=gen)
    seen = torch.rand(4, 300, generator=gen) < 0.1
    counts = (torch.rand(4, 300, generator=gen) < 0.05).float() * 2
    rep, presence, frequency = (
        torch.tensor([1.0, 1.2, 0.8, 1.5]),
        torch.tensor([0.0, 0.5, 1.0, 0.0]),
        torch.tensor([0.0, 0.1, 0.3, 1.0]),
    )
    want = apply_penalties(logits, seen, counts, rep, presence, frequency)
    got = triton_sampling.apply_penalties_(logits.clone(), seen, counts, rep, presence, frequency)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_sampling_returns_the_references_ids():
    """Greedy, plain, top-k (incl. 1), top-p, min-p and their mixes, with the same noise."""
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(6, 300, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 1.0])
    top_k, top_p = torch.tensor([0, 5, 0, 50, 1, 20]), torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.7])
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.2])
    noise = torch.empty(6, 300).exponential_(generator=gen)
    got = triton_sampling.sample(logits, temperature, top_k, top_p, min_p, noise)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    masked = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    want = torch.where(temperature == 0, logits.argmax(-1), sample_with_noise(masked.softmax(-1), noise))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, dtype",
    [(1, 4, 2, 64, 48, torch.float32), (37, 8, 2, 64, 40, torch.float32), (23, 4, 3, 32, 64, torch.bfloat16)],
)
def test_fused_experts_equal_the_torch_reference(tokens, experts, top_k, hidden, inter, dtype):
    """Grouped GEMMs over expert-sorted, block-padded slots (kernels/triton/moe.py) against one
    GEMM per expert (kernels/moe.py); experts no token picked, and padding, included."""
    from conveyor.kernels.moe import experts_reference
    from conveyor.kernels.triton.moe import BLOCK_M, align_slots, fused_experts

    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, -1] = -1e9  # the last expert is never picked
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    got = fused_experts(x, gate_up, down, weights.to(dtype), ids)
    want = experts_reference(x.float(), gate_up.float(), down.float(), weights.to(dtype).float(), ids)
    assert_close(got, want, dtype)
    sorted_slots, block_experts = align_slots(ids, experts)
    assert sorted_slots.numel() % BLOCK_M == 0 and block_experts.numel() == sorted_slots.numel() // BLOCK_M
    assert sorted(s for s in sorted_slots.tolist() if s < tokens * top_k) == list(range(tokens * top_k))


def test_a_moe_layer_on_the_fused_path_equals_its_per_expert_path():
    """engine/models/moe.py SparseMoe: the grouped-GEMM path a CUDA engine takes (stacked
    weights, other ranks' experts weighted 0 under expert parallel) against its linear per
    expert, here on CPU under the interpreter; the stacking leaves no second copy."""
    from conveyor.engine.models.moe import SparseMoe

    torch.manual_seed(0)
    moe = SparseMoe(64, num_experts=8, top_k=2, intermediate_size=48, renormalize=True).eval()
    for param in moe.parameters():
        param.data.normal_(0.0, 0.2)
    x = torch.randn(29, 64)
    with torch.no_grad():
        weights, chosen = moe.route(x)
        whole = moe._experts(x, weights, chosen)
        torch.testing.assert_close(moe.fused_experts(x, weights, chosen), whole, atol=1e-5, rtol=1e-5)
        gate_up, _ = moe.stacked_weights()
        assert moe.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
        moe.experts, moe.first_expert, moe._stacked = moe.experts[4:], 4, None  # rank 1 of 2
        half = moe._experts(x, weights, chosen)
        torch.testing.assert_close(moe.fused_experts(x, weights, chosen), half, atol=1e-5, rtol=1e-5)
        assert half.abs().sum() > 0 and not torch.allclose(half, whole)
