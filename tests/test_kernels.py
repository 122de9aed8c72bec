"""Paged attention and sampling kernels against plain dense references."""

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    prefill_attention,
    write_kv_cache,
)
from conveyor.kernels.cpu import extension
from conveyor.kernels.cpu.linear import CpuLinear, pack_linears, row_bucket
from conveyor.kernels.sampling import apply_top_k_top_p_min_p, sample_with_noise

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 6, 2, 16, 4, 40


def fill_cache(lengths, seed=0):
    """Random K/V for sequences of ``lengths`` written into scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(KV_HEADS, BLOCKS, BLOCK, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    tables, keys, values = [], [], []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        k = torch.randn(length, KV_HEADS, DIM, generator=gen)
        v = torch.randn(length, KV_HEADS, DIM, generator=gen)
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)])
        write_kv_cache(k, v, k_cache, v_cache, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


def dense_causal(q, k, v):
    """[n, H, D] queries at the last n positions of k/v [L, H_kv, D]."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=DIM**-0.5
    )
    return out.transpose(0, 1)


def test_decode_attention_matches_dense_on_both_paths():
    lengths = [1, 5, 17, 30]
    k_cache, v_cache, tables, keys, values = fill_cache(lengths)
    query = torch.randn(len(lengths), HEADS, DIM)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context_lens = torch.tensor(lengths)
    expected = torch.stack([dense_causal(query[i : i + 1], keys[i], values[i])[0] for i in range(len(lengths))])
    reference = paged_decode_attention_reference(query, k_cache, v_cache, block_tables, context_lens, DIM**-0.5)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    fast = paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, DIM**-0.5)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block",
    [(9, 3, 64, 16), (4, 4, 128, 16), (4, 2, 24, 16), (6, 2, 32, 8)],  # SmolLM2's; wide; odd dim; blocks of 8
)
def test_decode_attention_kernel_matches_the_reference_on_every_shape(heads, kv_heads, dim, block, cache_dtype):
    """The compiled kernel's block paths (AVX-512: a full block of 16 scores in one register sum,
    V rows accumulated in registers; elsewhere per-token loops) against the reference, with
    full and partial blocks and contexts up to 600 tokens; a bfloat16 cache (widened as it is
    read, float32 sums) against the reference on the same bf16 values."""
    gen = torch.Generator().manual_seed(dim + block)
    lengths = [1, 15, 16, 17, 48, 200, 600]
    blocks_needed = [-(-n // block) for n in lengths]
    k_cache = torch.randn(kv_heads, sum(blocks_needed) + 3, block, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(k_cache.shape[1], generator=gen)
    width = max(blocks_needed)
    tables, used = torch.zeros(len(lengths), width, dtype=torch.int32), 0
    for row, count in enumerate(blocks_needed):
        tables[row, :count] = order[used : used + count]
        used += count
    query = torch.randn(len(lengths), heads, dim, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    expected = paged_decode_attention_reference(query, k_cache, v_cache, tables, lens, dim**-0.5)
    fast = paged_decode_attention(query, k_cache, v_cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(fast, expected, atol=2e-6, rtol=1e-5)


def test_rotary_and_cache_writes_a_bfloat16_cache_as_the_float32_one_rounded():
    """The fused rotary + cache write stores bf16 where the cache is bf16: the float32 cache's
    values rounded to nearest; q and k rotate the same either way."""
    from conveyor.kernels.layer_ops import rotary_and_cache

    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(tokens, 1, dim, generator=gen) * 6
    slots = torch.tensor([3, 9, 10, 0, 17])
    written = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        caches = [torch.zeros(kv_heads, 5, 4, dim, dtype=dtype) for _ in range(2)]
        q, k = rotary_and_cache(q, k, v, (angles.cos(), angles.sin()), *caches, slots)
        written[dtype] = (q.clone(), k.clone(), *caches)
    (q32, k32, kc32, vc32), (q16, k16, kc16, vc16) = written[torch.float32], written[torch.bfloat16]
    assert torch.equal(q32, q16) and torch.equal(k32, k16)
    assert torch.equal(kc16, kc32.bfloat16()) and torch.equal(vc16, vc32.bfloat16())


def test_cpu_kernel_builds_here():
    assert extension.load() is not None, "g++ and torch headers are on this machine: the kernel must build"


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 16])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 70), (7, 16)])
def test_few_rows_linear_matches_f_linear(rows, out_features, in_features):
    """Weight row counts that leave a remainder after the row groups, and input widths that
    are not a multiple of the vector width (masked loads), with and without bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    kernels = extension.load()
    torch.testing.assert_close(
        kernels.few_rows_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(kernels.few_rows_linear(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 70, 600])
def test_cpu_linear_matches_f_linear_on_every_path(rows):
    """Few rows (compiled kernel), more rows (oneDNN on the packed copy, padded to a row
    bucket), with bias."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    linear = CpuLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias))
    linear.pack(extension.load())
    x = torch.randn(rows, 40, generator=gen)
    out = linear(x)
    assert out.shape == (rows, 48) and row_bucket(rows) >= rows
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_few_rows_linear_on_interleaved_rows_matches_f_linear(rows):
    kernels = extension.load()
    if not kernels.interleaved_supported():
        pytest.skip("the interleaved layout needs AVX-512")
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    interleaved = kernels.interleave_rows(weight)
    assert interleaved.shape == (6, 4, 16, 16)
    torch.testing.assert_close(
        kernels.few_rows_linear(x, interleaved, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5
    )
    module = torch.nn.Sequential(CpuLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias)))
    pack_linears(module, kernels)
    assert module[0].fast_path[0].dim() == 4, "a 96 x 64 weight gets the interleaved copy"
    torch.testing.assert_close(module(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_prefill_attention_over_cached_prefix():
    k_cache, v_cache, tables, keys, values = fill_cache([23])
    query = torch.randn(23, HEADS, DIM)
    table = torch.tensor(tables[0])
    expected = dense_causal(query, keys[0], values[0])
    fresh = prefill_attention(query, keys[0], values[0], k_cache, v_cache, table, 0, DIM**-0.5)
    torch.testing.assert_close(fresh, expected, atol=1e-5, rtol=1e-5)
    chunk = prefill_attention(query[15:], keys[0][15:], values[0][15:], k_cache, v_cache, table, 15, DIM**-0.5)
    torch.testing.assert_close(chunk, expected[15:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "block, dim, cache_dtype",
    [(16, 64, torch.bfloat16), (16, 64, torch.float32), (16, 192, torch.bfloat16), (4, 24, torch.float32)],
)
def test_prefill_rows_are_the_same_numbers_in_any_chunk_and_as_decode(block, dim, cache_dtype):
    """The compiled prefill reads the cache as stored and computes each token's row as a decode
    step at that position does: bit for bit the same whole, in chunks after a cached prefix,
    and one token at a time (issue 40); close to dense attention. (16, 64) and (16, 192): the
    vector paths (a head of up to 128, or of up to 256); (4, 24): the plain loops."""
    kernels = extension.load()
    if kernels is None:
        pytest.skip("no compiled CPU kernels")
    gen = torch.Generator().manual_seed(block)
    n, heads, kv_heads = 45, 6, 2
    blocks = torch.randperm(64, generator=gen)[: -(-n // block)]
    k_cache = torch.randn(kv_heads, 64, block, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(kv_heads, 64, block, dim, generator=gen).to(cache_dtype)
    query = torch.randn(n, heads, dim, generator=gen)
    scale = dim**-0.5
    whole = kernels.paged_prefill_attention(query, k_cache, v_cache, blocks, 0, scale)
    for split in (1, block, block + 3, n - 1):
        chunk = kernels.paged_prefill_attention(query[split:].contiguous(), k_cache, v_cache, blocks, split, scale)
        assert torch.equal(chunk, whole[split:]), f"chunk after {split} cached tokens"
    decode = kernels.paged_decode_attention(
        query, k_cache, v_cache, blocks[None].expand(n, -1).contiguous(), torch.arange(1, n + 1), scale
    )
    assert torch.equal(decode, whole)
    k = k_cache[:, blocks].reshape(kv_heads, -1, dim)[:, :n].transpose(0, 1).float()
    v = v_cache[:, blocks].reshape(kv_heads, -1, dim)[:, :n].transpose(0, 1).float()
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(whole, expected, atol=2e-5, rtol=1e-5)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    masked = apply_top_k_top_p_min_p(
        logits,
        top_k=torch.tensor([2, 0, 0, 0]),
        top_p=torch.tensor([1.0, 0.7, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.2, 0.0]),
    )
    kept = torch.isfinite(masked)
    assert kept.tolist() == [
        [True, True, False, False],  # top_k 2
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.7
        [True, True, True, False],  # >= 0.2 * 0.5
        [True, True, True, True],
    ]


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]]).expand(20000, 3)
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_with_noise(probs, noise), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)


# ---- GGUF-block weights (kernels/quant.py, kernels/csrc/quant_linear_cpu.cpp) -------------
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_packed(type_name: str, out_features: int, in_features: int, seed: int):
    """A random weight quantized by gguf-py, packed, and gguf-py's own dequantization of it."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    from conveyor.kernels.quant import pack_gguf_blocks

    qtype = GGMLQuantizationType[type_name]
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    raw = quantize(weight, qtype)
    return pack_gguf_blocks(raw, int(qtype)), torch.from_numpy(gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_packed_gguf_blocks_dequantize_like_gguf_py(type_name):
    """Bit for bit, in the torch reference and the compiled kernel."""
    from conveyor.kernels.quant import dequantize

    packed, expected = gguf_packed(type_name, 37, 96, seed=1)
    assert torch.equal(dequantize(packed), expected)
    assert torch.equal(extension.load().dequantize_weight(packed, 96), expected)
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(dequantize(packed, rows), expected[rows])


@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 70])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 160), (5, 32)])
def test_quantized_linear_matches_dequantize_then_matmul(type_name, rows, out_features, in_features):
    """Up to 8 rows: the register-unpacking kernel (row groups with a remainder, one or two
    rows of x per tile); more: dequantized tiles through torch's mm. Same weights as the
    dequantized model, so only the order of the sum differs: tolerance of float32 rounding."""
    packed, dense = gguf_packed(type_name, out_features, in_features, seed=rows * 7 + out_features)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, in_features, generator=gen), torch.randn(out_features, generator=gen)
    kernels = extension.load()
    for b in (bias, None):
        expected = F.linear(x, dense, b)
        torch.testing.assert_close(kernels.quantized_linear(x, packed, b), expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(kernels.few_rows_linear(x, packed, b), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("per_thread", [False, True])
def test_quantized_linear_tiles_shared_or_per_thread(type_name, per_thread):
    """The many-rows path with small tiles (several per call, a short last one), either
    tiling: the same weights as the dequantized model."""
    packed, dense = gguf_packed(type_name, 101, 64, seed=3)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(20, 64, generator=gen), torch.randn(101, generator=gen)
    kernels = extension.load()
    try:
        kernels.set_quant_tiling(16 * 64 * 4, per_thread)
        for b in (bias, None):
            torch.testing.assert_close(
                kernels.quantized_linear(x, packed, b), F.linear(x, dense, b), atol=2e-5, rtol=1e-5
            )
    finally:
        kernels.set_quant_tiling(CpuLinear.QUANT_TILE_BYTES, CpuLinear.QUANT_PER_THREAD_TILES)


@pytest.mark.parametrize("rows", [1, 2, 12])
def test_cpu_linear_over_packed_blocks_and_the_torch_reference(rows):
    from conveyor.kernels.quant import QuantLinear

    packed, dense = gguf_packed("Q4_1", 48, 64, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 64, generator=gen), torch.randn(48, generator=gen)
    reference = QuantLinear(packed, torch.nn.Parameter(bias))
    torch.testing.assert_close(reference(x), F.linear(x, dense, bias), atol=2e-5, rtol=1e-5)
    module = torch.nn.Sequential(reference)
    from conveyor.kernels.cpu.linear import swap_linears

    swap_linears(module)
    pack_linears(module, extension.load())
    assert isinstance(module[0], CpuLinear) and module[0].fast_path[0] is module[0].weight
    torch.testing.assert_close(module(x), F.linear(x, dense, bias), atol=2e-5, rtol=1e-5)


def test_quantized_linear_per_thread_tiles_on_two_threads_in_inference_mode():
    """torch's worker threads do not inherit inference mode: the per-thread tiles' mm into
    the output must still be allowed there (the model runner executes steps in it)."""
    packed, dense = gguf_packed("Q4_1", 101, 64, seed=4)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    kernels, threads = extension.load(), torch.get_num_threads()
    try:
        kernels.set_quant_tiling(16 * 64 * 4, True)
        torch.set_num_threads(2)
        with torch.inference_mode():
            out = kernels.quantized_linear(x, packed, None)
        torch.testing.assert_close(out, F.linear(x, dense), atol=2e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
        kernels.set_quant_tiling(CpuLinear.QUANT_TILE_BYTES, CpuLinear.QUANT_PER_THREAD_TILES)


@pytest.mark.parametrize("mode", ["float32_copy", "bf16_copy"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 40])
def test_cpu_linear_batch_copy_serves_many_rows(mode, rows):
    """quantization='auto': the blocks serve up to the CPU's crossover (``blocks_max_rows``), a
    oneDNN copy of the dequantized weight more: float32, equal to the dequantized model up to
    summation order; bfloat16 (weights and x rounded to bf16, float32 sums), within what bf16's
    rounding of both factors can move each output."""
    from conveyor.kernels.cpu.dispatch import cpu_flags, gguf_blocks_max_rows
    from conveyor.kernels.cpu.linear import swap_linears
    from conveyor.kernels.quant import QuantLinear

    packed, dense = gguf_packed("Q4_1", 48, 64, seed=rows)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(rows + 1))
    module = torch.nn.Sequential(QuantLinear(packed, bias))
    swap_linears(module)
    pack_linears(module, extension.load(), gguf_mode=mode)
    weight, _, copy = module[0].fast_path
    # oneDNN reorders a bf16 weight only where it has bf16 kernels (AVX-512 and up)
    copy_made = torch.backends.mkldnn.is_available() and (
        mode == "float32_copy" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert weight is module[0].weight and (copy is not None) == copy_made
    assert module[0].blocks_max_rows == gguf_blocks_max_rows(cpu_flags(), mode)
    on_copy = copy is not None and rows > module[0].blocks_max_rows
    expected = F.linear(x, dense, bias)
    if mode == "bf16_copy" and on_copy:
        assert copy.dtype == torch.bfloat16
        # each product's two factors rounded to bf16 (2^-9 relative each): |error| <= 2^-8 sum |w x|
        bound = F.linear(x.abs(), dense.abs()) * 2**-8 + 1e-5
        assert ((module(x) - expected).abs() <= bound).all()
    else:
        torch.testing.assert_close(module(x), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_bf16_output_product_feeds_silu_and_the_next_layer(rows):
    """A gate_up-like CpuLinear (``bf16_output``) on its bf16 copy hands bf16 to silu_and_mul,
    whose bf16 result the next CpuLinear takes as it is; on the blocks both stay float32. The
    chain stays within bf16's rounding of the float32 one."""
    from conveyor.kernels.cpu.linear import swap_linears
    from conveyor.kernels.layer_ops import silu_and_mul
    from conveyor.kernels.quant import QuantLinear

    gate_up, gate_up_dense = gguf_packed("Q4_1", 128, 64, seed=1)
    down, down_dense = gguf_packed("Q4_1", 64, 64, seed=2)
    model = torch.nn.Module()
    model.BF16_OUTPUT_LINEARS = ("gate_up_proj",)
    model.gate_up_proj, model.down_proj = QuantLinear(gate_up, None), QuantLinear(down, None)
    swap_linears(model)
    pack_linears(model, extension.load(), gguf_mode="bf16_copy")
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    hidden = model.gate_up_proj(x)
    on_copy = model.gate_up_proj.fast_path[2] is not None and rows > model.gate_up_proj.blocks_max_rows
    assert hidden.dtype == (torch.bfloat16 if on_copy else torch.float32)
    out = model.down_proj(silu_and_mul(hidden))
    assert out.dtype == torch.float32 and not model.down_proj.bf16_output
    expected = F.linear(silu_and_mul(F.linear(x, gate_up_dense)), down_dense)
    if on_copy:  # two linears and a SiLU in bf16: about 2^-8 relative each, of the whole output
        assert (out - expected).norm() <= 0.02 * expected.norm()
    else:  # two float32 linears whose sums run in another order than torch's, and a SiLU
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_takes_a_bf16_product_into_the_float32_stream(x_dtype):
    """o_proj's and down_proj's bf16 products (``BF16_OUTPUT_LINEARS``) go into add_rms_norm as
    they are: the float32 residual gains them exactly (as float32 adds), and the norm is
    written back into x in x's dtype, within one bf16 rounding of the float32 norm."""
    from conveyor.kernels.layer_ops import add_rms_norm, rms_norm_reference

    if extension.load() is None:
        pytest.skip("no compiled CPU kernels on this machine")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 576, generator=gen).to(x_dtype)
    residual, weight = torch.randn(7, 576, generator=gen), torch.rand(576, generator=gen) + 0.5
    expected_residual = residual + x.float()
    expected = rms_norm_reference(expected_residual, weight, 1e-5)
    normed, new_residual = add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert normed.dtype == x_dtype and new_residual.dtype == torch.float32
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    rtol = 2**-8 if x_dtype is torch.bfloat16 else 1e-5  # the sum of squares' order differs
    torch.testing.assert_close(normed.float(), expected, atol=1e-6, rtol=rtol)


def test_a_float32_layer_reads_a_bf16_product_as_float32():
    """A layer without a bf16 copy (a dense float32 weight, or GGUF blocks alone) behind a
    bf16_output one widens the bf16 x it gets and answers float32."""
    from conveyor.kernels.cpu.linear import swap_linears
    from conveyor.kernels.quant import QuantLinear

    packed, dense = gguf_packed("Q4_1", 48, 64, seed=5)
    model = torch.nn.Module()
    model.blocks, model.dense = QuantLinear(packed, None), torch.nn.Linear(64, 48)
    swap_linears(model)
    pack_linears(model, extension.load(), gguf_mode="blocks")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    for layer, weight, bias in ((model.blocks, dense, None), (model.dense, model.dense.weight, model.dense.bias)):
        out = layer(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x.float(), weight, bias), atol=2e-5, rtol=1e-5)


def test_compiled_silu_and_mul_matches_torch_in_float32_and_bfloat16():
    """The compiled SiLU (a vectorized e^-|x|) is within float32's rounding of torch's, over
    the range that matters and at the ends (no overflow far below zero); in bfloat16 within
    one bf16 rounding of torch's float32 result."""
    kernels = extension.load()
    if kernels is None:
        pytest.skip("no compiled CPU kernels on this machine")
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.tensor([-1e4, -88.0, -1e-30, 0.0, 1e-30, 1e4])])
    up = torch.randn(gate.numel(), generator=torch.Generator().manual_seed(0))
    gate_up = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), up])])
    gate2, up2 = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate2) * up2
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), expected, atol=1e-30, rtol=5e-7)
    as_bf16 = gate_up.bfloat16()
    gate_b, up_b = as_bf16.float().chunk(2, dim=-1)
    out = kernels.silu_and_mul(as_bf16)
    assert out.dtype == torch.bfloat16  # within one bf16 rounding (2^-8 relative) of torch's
    torch.testing.assert_close(out.float(), F.silu(gate_b) * up_b, atol=1e-30, rtol=2**-8)


@pytest.mark.slow
def test_isa_specific_kernels_compile_for_an_avx2_only_cpu(tmp_path):
    """The extension is built with -march=native, so this machine's own build cannot show a
    kernel whose `#pragma GCC target` region uses an intrinsic outside it (an AVX512DQ one
    under "avx512f,...": the whole extension then fails on AVX2 machines and every compiled
    path is lost). The files with such regions compile here as for an AVX2-only CPU
    (x86-64-v3), in one translation unit (torch's headers are most of the time)."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    probe = tmp_path / "probe.cpp"
    probe.write_text("".join(f'#include "{extension.CSRC / name}"\n' for name in ISA_SPECIFIC_SOURCES))
    includes = [arg for path in [*include_paths(), sysconfig.get_paths()["include"]] for arg in ("-I", path)]
    # -O0: always_inline intrinsics are inlined (and their target checked) at every level
    flags = [f for f in extension.CFLAGS if f not in ("-march=native", "-O3")] + ["-march=x86-64-v3", "-O0"]
    command = ["g++", *flags, "-std=c++17", "-DTORCH_EXTENSION_NAME=probe", "-c", str(probe), "-o", "/dev/null"]
    result = subprocess.run(command + includes, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, errors[:3]


ISA_SPECIFIC_SOURCES = ["int8_dot_cpu.cpp", "int8_gemm_cpu.cpp"]  # the files with `#pragma GCC target`


def test_a_stale_build_lock_never_blocks_a_load(tmp_path):
    """A build killed mid-way leaves torch's `lock` file: the next builder, holding the build
    flock (so no live process is building), removes it and carries on instead of waiting."""
    import shutil

    name, build_dir = extension._build_location()
    shutil.copy(build_dir / f"{name}.so", tmp_path / f"{name}.so")
    (tmp_path / "lock").touch()
    assert extension.remove_stale_lock(tmp_path) and not (tmp_path / "lock").exists()
    assert not extension.remove_stale_lock(tmp_path)
    (tmp_path / "lock").touch()
    module = extension._build(name, tmp_path)  # the library is there: imported under the flock, no wait
    assert module.int8_dot_isas() == extension.load().int8_dot_isas()
