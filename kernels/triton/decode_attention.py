"""Paged decode attention: one new query token per sequence over its cached keys.

One program per (sequence, KV head, split): the query heads sharing that KV head (GQA)
read each key once, and a long context is cut into ``num_splits`` ranges of key tiles
computed in parallel (split-K, flash-decoding). Each split leaves its partial output and
log-sum-exp; a second pass merges them per query head. Keys are gathered token by token
through the block table, so a tile may span cache blocks and any block size works.
"""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import interpreted

# keys per iteration of a split; the interpreter's cost is per operation, not per element
TILE = 256 if interpreted() else 32
TILE_ELEMENTS = 8192  # a GPU program's [group, tile, head_dim] product tile, kept in registers
MIN_TILES_PER_SPLIT = 4  # below this a split's fixed cost outweighs its parallelism
MAX_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    partial_out,
    partial_lse,
    scale,
    num_splits,
    query_stride_b,
    query_stride_h,
    table_stride_b,
    cache_stride_h,
    cache_stride_b,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    output,
    out_stride_b,
    out_stride_h,
    DIRECT: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(context_lens + seq)
    tiles = tl.cdiv(context, TILE_N)
    per_split = tl.cdiv(tiles, num_splits)
    first, last = split * per_split, tl.minimum((split + 1) * per_split, tiles)

    rows, dims = tl.arange(0, GROUP_P), tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    q = tl.load(
        query + seq * query_stride_b + heads[:, None] * query_stride_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    cache_head = kv_head * cache_stride_h
    for tile in range(first, last):
        positions = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = positions < context
        blocks = tl.load(block_tables + seq * table_stride_b + positions // BLOCK_SIZE, mask=key_ok, other=0)
        offsets = cache_head + blocks * cache_stride_b + (positions % BLOCK_SIZE) * HEAD_DIM
        tile_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, TILE_N]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    empty = l_i == 0.0  # a split with no keys: weight 0 in the merge
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    if DIRECT:  # one split: its result is the output
        tl.store(
            output + seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :],
            out.to(output.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        slot = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [B, H_q, S] flat
        tl.store(partial_out + slot[:, None] * BLOCK_D + dims[None, :], out, mask=row_ok[:, None])
        tl.store(partial_lse + slot, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    partial_out,
    partial_lse,
    output,
    num_splits,
    out_stride_b,
    out_stride_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEADS_P: tl.constexpr,
):
    """One program per sequence, all its query heads: [heads, splits, dims] tiles."""
    seq = tl.program_id(0)
    heads, splits, dims = tl.arange(0, HEADS_P), tl.arange(0, SPLITS_P), tl.arange(0, BLOCK_D)
    slots = (seq * num_heads + heads[:, None]) * num_splits + splits[None, :]  # [heads, splits]
    ok = (heads[:, None] < num_heads) & (splits[None, :] < num_splits)
    lse = tl.load(partial_lse + slots, mask=ok, other=float("-inf"))
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top[:, None]))
    parts = tl.load(partial_out + slots[:, :, None] * BLOCK_D + dims[None, None, :], mask=ok[:, :, None], other=0.0)
    total = tl.sum(weights, axis=1)
    merged = tl.sum(parts * weights[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        output + seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :],
        merged.to(output.dtype.element_ty),
        mask=(heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM),
    )


def choose_splits(max_blocks: int, block_size: int, parallel_programs: int, tile: int = TILE) -> int:
    """Splits per (sequence, KV head): enough programs to fill a GPU's SMs on long contexts,
    each with at least ``MIN_TILES_PER_SPLIT`` tiles. Depends only on shapes (no host sync)."""
    tiles = -(-max_blocks * block_size // tile)
    by_length = max(1, tiles // MIN_TILES_PER_SPLIT)
    wanted = max(1, -(-132 * 2 // max(1, parallel_programs)))  # ~2 programs per SM of an H100/H200
    return min(MAX_SPLITS, by_length, wanted)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.attention.paged_decode_attention_reference``; a context
    length of 0 (a padded row) gives zeros. ``num_splits``/``tile`` (keys per iteration, a
    power of 2) default to choices by shape."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    assert query.stride(-1) == 1 and k_cache.stride()[2:] == (head_dim, 1) and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if tile is None:  # wide GQA groups and heads take shorter tiles (registers)
        tile = TILE if interpreted() else max(16, min(64, TILE_ELEMENTS // (triton.next_power_of_2(group) * block_d)))
    if num_splits is None:
        num_splits = choose_splits(block_tables.shape[1], block_size, batch * num_kv_heads, tile)
    output = torch.empty_like(query)
    if batch == 0:
        return output
    direct = num_splits == 1
    partial_shape = (1, 1, 1, 1) if direct else (batch, num_heads, num_splits, block_d)  # unused if direct
    partial_out = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(partial_shape[:3], dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_lse,
        scale,
        num_splits,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        TILE_N=tile,
        output=output,
        out_stride_b=output.stride(0),
        out_stride_h=output.stride(1),
        DIRECT=direct,
    )
    if not direct:
        _merge_splits_kernel[(batch,)](
            partial_out,
            partial_lse,
            output,
            num_splits,
            output.stride(0),
            output.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            SPLITS_P=triton.next_power_of_2(num_splits),
            HEADS_P=triton.next_power_of_2(num_heads),
        )
    return output
