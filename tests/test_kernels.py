"""Paged attention and sampling kernels against plain dense references."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension
from kernels.cpu.linear import CpuLinear, pack_linears, row_bucket
from kernels.attention import (paged_decode_attention, paged_decode_attention_reference,
                               prefill_attention, write_kv_cache)
from kernels.sampling import apply_top_k_top_p_min_p, sample_with_noise

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
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=DIM ** -0.5)
    return out.transpose(0, 1)


def test_decode_attention_matches_dense_on_both_paths():
    lengths = [1, 5, 17, 30]
    k_cache, v_cache, tables, keys, values = fill_cache(lengths)
    query = torch.randn(len(lengths), HEADS, DIM)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context_lens = torch.tensor(lengths)
    expected = torch.stack([dense_causal(query[i:i + 1], keys[i], values[i])[0] for i in range(len(lengths))])
    reference = paged_decode_attention_reference(query, k_cache, v_cache, block_tables, context_lens, DIM ** -0.5)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    fast = paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, DIM ** -0.5)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)


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
    torch.testing.assert_close(kernels.few_rows_linear(x, weight, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-5)
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
    torch.testing.assert_close(kernels.few_rows_linear(x, interleaved, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-5)
    module = torch.nn.Sequential(CpuLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias)))
    pack_linears(module, kernels)
    assert module[0].fast_path[0].dim() == 4, "a 96 x 64 weight gets the interleaved copy"
    torch.testing.assert_close(module(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_prefill_attention_over_cached_prefix():
    k_cache, v_cache, tables, keys, values = fill_cache([23])
    query = torch.randn(23, HEADS, DIM)
    table = torch.tensor(tables[0])
    expected = dense_causal(query, keys[0], values[0])
    fresh = prefill_attention(query, keys[0], values[0], k_cache, v_cache, table, 0, DIM ** -0.5)
    torch.testing.assert_close(fresh, expected, atol=1e-5, rtol=1e-5)
    chunk = prefill_attention(query[15:], keys[0][15:], values[0][15:], k_cache, v_cache, table, 15, DIM ** -0.5)
    torch.testing.assert_close(chunk, expected[15:], atol=1e-5, rtol=1e-5)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    masked = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([2, 0, 0, 0]),
                                     top_p=torch.tensor([1.0, 0.7, 1.0, 1.0]),
                                     min_p=torch.tensor([0.0, 0.0, 0.2, 0.0]))
    kept = torch.isfinite(masked)
    assert kept.tolist() == [[True, True, False, False],  # top_k 2
                             [True, True, False, False],  # 0.5 + 0.3 reaches 0.7
                             [True, True, True, False],  # >= 0.2 * 0.5
                             [True, True, True, True]]


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]]).expand(20000, 3)
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_with_noise(probs, noise), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)
