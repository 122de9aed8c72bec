"""The KV-cache write (vLLM's reshape_and_cache): a step's keys and values ``[T, H_kv, D]``
into their flat slots of a cache laid out ``[H_kv, num_blocks, block_size, D]``. A slot
below 0 is padding (a CUDA graph's unused rows) and writes nothing."""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import interpreted

TOKENS_PER_PROGRAM = 256 if interpreted() else 16  # the interpreter's cost is per program


@triton.jit
def _write_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slots,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_h,
    num_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots + tokens, mask=tokens < num_tokens, other=-1)
    dims = tl.arange(0, BLOCK_D)
    mask = (slot[:, None] >= 0) & (dims[None, :] < HEAD_DIM)
    tokens, dims2 = tokens[:, None], dims[None, :]
    k = tl.load(key + tokens * key_stride_t + head * key_stride_h + dims2, mask=mask)
    v = tl.load(value + tokens * value_stride_t + head * value_stride_h + dims2, mask=mask)
    target = head * cache_stride_h + slot[:, None] * HEAD_DIM + dims2
    tl.store(k_cache + target, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + target, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``kernels.attention.write_kv_cache`` (plus: negative slots skipped)."""
    tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(-1) == value.stride(-1) == 1 and k_cache.stride()[1:] == v_cache.stride()[1:]
    assert k_cache.stride(1) == k_cache.shape[2] * head_dim and k_cache.stride(2) == head_dim
    if tokens == 0:
        return
    _write_kv_kernel[(triton.cdiv(tokens, TOKENS_PER_PROGRAM), num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=TOKENS_PER_PROGRAM,
    )
