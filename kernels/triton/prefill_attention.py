"""Varlen prefill attention over the paged cache: each span of the flat batch is one
sequence's new tokens (a whole prompt, a chunk of one, or the rest after a prefix-cache
hit), attending to its ``prefix_len`` cached tokens and causally to itself. The new keys are
already in the cache (written before attention), so every key is read through the block
table and one launch covers every span of the step.

One program per (query tile, span, query head): flash attention's online softmax over key
tiles up to the tile's last query position.
"""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import interpreted

# query rows per program (16: the smallest tl.dot tile) and keys per iteration; the
# interpreter's cost is per operation, not per element, so it takes big tiles
BLOCK_M = 128 if interpreted() else 16
BLOCK_N = 128 if interpreted() else 32


@triton.jit
def _prefill_kernel(
    query,
    k_cache,
    v_cache,
    output,
    span_starts,
    span_lens,
    prefix_lens,
    block_tables,
    scale,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride,
    cache_stride_h,
    cache_stride_b,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile_m, span, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(span_lens + span)
    if tile_m * TILE_M < length:
        start, prefix = tl.load(span_starts + span), tl.load(prefix_lens + span)
        rows, dims = tile_m * TILE_M + tl.arange(0, TILE_M), tl.arange(0, BLOCK_D)
        row_ok, dim_ok = rows < length, dims < HEAD_DIM
        q = tl.load(
            query + (start + rows)[:, None] * query_stride_t + head * query_stride_h + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q_pos = prefix + rows
        m_i = tl.full([TILE_M], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE_M], tl.float32)
        acc = tl.zeros([TILE_M, BLOCK_D], tl.float32)
        cache_head = (head // GROUP) * cache_stride_h
        end = prefix + tl.minimum(length, (tile_m + 1) * TILE_M)  # keys this tile can see
        for key_start in range(0, end, TILE_N):
            positions = key_start + tl.arange(0, TILE_N)
            key_ok = positions < end
            blocks = tl.load(block_tables + span * table_stride + positions // BLOCK_SIZE, mask=key_ok, other=0)
            offsets = cache_head + blocks * cache_stride_b + (positions % BLOCK_SIZE) * HEAD_DIM
            tile_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_cache + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            if IEEE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            visible = (positions[None, :] <= q_pos[:, None]) & key_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see nothing
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            output + (start + rows)[:, None] * out_stride_t + head * out_stride_h + dims[None, :],
            out.to(output.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def prefill_attention_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    output: torch.Tensor,
    span_starts: torch.Tensor,
    span_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_span_len: int,
    scale: float,
    exact: bool = True,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> None:
    """Writes the rows of ``output`` ``[T, H, D]`` that the spans cover. Per span ``i``: rows
    ``span_starts[i] : span_starts[i] + span_lens[i]`` of ``query``, ``prefix_lens[i]`` cached
    tokens before them, block table row ``block_tables[i]``. ``max_span_len`` (a host int)
    sizes the grid. ``exact``: float32 products (tf32 on a GPU otherwise)."""
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    assert query.stride(-1) == output.stride(-1) == 1 and k_cache.stride()[2:] == (head_dim, 1)
    num_spans = span_lens.shape[0]
    if num_spans == 0 or max_span_len == 0:
        return
    grid = (triton.cdiv(max_span_len, block_m), num_spans, num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        output,
        span_starts,
        span_lens,
        prefix_lens,
        block_tables,
        scale,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_M=block_m,
        TILE_N=block_n,
        IEEE_DOT=exact,
    )
