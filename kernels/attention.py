"""Attention over a paged KV cache: cache writes, decode and prefill paths.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's
keys live in the blocks its block table lists, in order. These are torch reference
implementations that run anywhere (CPU included); they read only the blocks a step needs.
"""
import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, H_kv, D]`` at flat slots ``slot_mapping`` ``[T]``."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[B, max_blocks]`` block ids -> ``[B, H_kv, max_blocks * block_size, D]``."""
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache[block_tables]  # [B, max_blocks, block_size, H_kv, D]
    return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One new token per sequence. ``query`` ``[B, H_q, D]`` -> ``[B, H_q, D]``.

    ``block_tables`` ``[B, max_blocks]`` (padding entries may hold any valid block id) and
    ``context_lens`` ``[B]`` (tokens in cache, the new one included).
    """
    keys = gather_blocks(k_cache, block_tables)
    values = gather_blocks(v_cache, block_tables)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      prefix_len: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new tokens ``[n, H, D]`` over its cached prefix
    (``prefix_len`` tokens, already in the cache) plus themselves (also already written)."""
    n = query.shape[0]
    q = query.transpose(0, 1)
    if prefix_len == 0:  # nothing cached before: attend to the new keys directly
        out = F.scaled_dot_product_attention(q, key.transpose(0, 1), value.transpose(0, 1),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    total = prefix_len + n
    keys = gather_blocks(k_cache, block_table[None])[0, :, :total]
    values = gather_blocks(v_cache, block_table[None])[0, :, :total]
    q_pos = torch.arange(prefix_len, total, device=query.device)
    k_pos = torch.arange(total, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)
