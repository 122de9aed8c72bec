"""Attention over a paged KV cache: cache writes, decode and prefill paths.

Cache layout per layer: ``[num_kv_heads, num_blocks, block_size, head_dim]``. A sequence's
keys live in the blocks its block table lists, in order. Keeping heads outermost lets a
gather of whole blocks come out as ``[H_kv, B, L, D]``, which batched matmuls consume
without another copy. These torch reference implementations run anywhere (CPU included)
and read only the blocks a step needs.
"""

import torch
import torch.nn.functional as F

from conveyor.kernels.cpu.extension import for_tensors

# a CPU cache may be bfloat16 under float32 activations (ModelRunner's kv_cache_dtype): the
# compiled kernels widen it on the fly, the reference paths cast what they gather
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` ``[T, H_kv, D]`` at flat slots ``slot_mapping`` ``[T]``."""
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1).to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[B, max_blocks]`` block ids -> ``[H_kv, B, max_blocks * block_size, D]``."""
    num_kv_heads, _, block_size, head_dim = cache.shape
    batch, max_blocks = block_tables.shape
    return cache[:, block_tables].view(num_kv_heads, batch, max_blocks * block_size, head_dim)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention on the fastest path for the device (the fused CPU kernel reads the
    blocks in place; elsewhere the reference path)."""
    kernels = for_tensors(query) and for_tensors(k_cache, dtypes=KV_CACHE_DTYPES)
    if kernels is not None:
        return kernels.paged_decode_attention(query.contiguous(), k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_reference(query, k_cache, v_cache, block_tables, context_lens, scale)


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence. ``query`` ``[B, H_q, D]`` -> ``[B, H_q, D]``.

    ``block_tables`` ``[B, max_blocks]`` (padding entries may hold any valid block id) and
    ``context_lens`` ``[B]`` (tokens in cache, the new one included).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    keys = gather_blocks(k_cache, block_tables).to(query.dtype)  # [H_kv, B, L, D]
    values = gather_blocks(v_cache, block_tables).to(query.dtype)
    # query heads of one kv head form the rows: [H_kv, B, group, D]
    q = query.view(batch, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [H_kv, B, group, L]
    positions = torch.arange(keys.shape[2], device=query.device)
    padding = positions[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(padding[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values)  # [H_kv, B, group, D]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens ``[n, H, D]`` over its cached prefix
    (``prefix_len`` tokens, already in the cache) plus themselves (also already written).

    The compiled CPU kernel reads every key and value from the cache, as stored, and computes
    each token's row as a decode step at that position would: a token's attention does not
    depend on whether its prefix was computed in this chunk or read from the prefix cache,
    nor on the chunk it came in (issue 40). The torch path below (other devices, or no
    compiler) makes no such promise."""
    kernels = for_tensors(query) and for_tensors(k_cache, dtypes=KV_CACHE_DTYPES)
    if kernels is not None:
        return kernels.paged_prefill_attention(query.contiguous(), k_cache, v_cache, block_table, prefix_len, scale)
    return prefill_attention_reference(query, key, value, k_cache, v_cache, block_table, prefix_len, scale)


def prefill_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """``prefill_attention`` on torch's SDPA."""
    # 4-D ([1, H, n, D]) inputs: torch only takes its fused (flash) CPU kernel for those; on
    # 3-D ones it falls back to the math path, 1.5-4.5x slower on long prompts.
    n = query.shape[0]
    q = query.transpose(0, 1)[None]
    if prefix_len == 0:  # nothing cached before: attend to the new keys directly
        out = F.scaled_dot_product_attention(
            q, key.transpose(0, 1)[None], value.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    total = prefix_len + n
    keys = gather_blocks(k_cache, block_table[None])[:, 0, :total].to(query.dtype)
    values = gather_blocks(v_cache, block_table[None])[:, 0, :total].to(query.dtype)
    q_pos = torch.arange(prefix_len, total, device=query.device)
    k_pos = torch.arange(total, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
