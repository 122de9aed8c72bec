"""A mixture-of-experts layer's experts as two grouped GEMMs (vLLM's fused-MoE layout): the
step's (token, expert) slots are sorted by expert and padded to blocks of BLOCK_M, so every
program multiplies one block of one expert's rows by that expert's weights. First the fused
gate/up projection of each slot's token, then SiLU-and-mul, then the down projection of
each slot, scaled by its routing weight; each token's top-k outputs are summed at the end.

The torch reference is kernels/moe.py ``experts_reference`` (one GEMM per expert over its
tokens, engine/models/moe.py's order). Accumulation is float32; float32 inputs use IEEE
dots (no TF32), so float32 results equal the reference to rounding."""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import layer_ops

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tl.dot wants 16+ in each dimension


@triton.jit
def _grouped_gemm_kernel(
    a,
    b,
    c,
    sorted_slots,
    block_experts,
    scale,
    num_slots,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    ROWS_ARE_TOKENS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    slots = tl.load(sorted_slots + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots  # padding slots point past the end
    expert = tl.load(block_experts + block).to(tl.int64)
    rows = slots // TOP_K if ROWS_ARE_TOKENS else slots
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(a + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        b_tile = tl.load(
            b + expert * stride_be + n[None, :] * stride_bn + k[:, None],
            mask=(n[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32), input_precision="ieee")
    if SCALED:
        acc *= tl.load(scale + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c + slots[:, None] * stride_cm + n[None, :], acc.to(c.dtype.element_ty), mask=valid[:, None] & (n[None, :] < N)
    )


def align_slots(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots (token * top_k + choice) sorted by expert, each expert's run padded to a
    multiple of BLOCK_M with the past-the-end slot, and the expert of each block."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = torch.cumsum(padded, 0) - padded
    first_of_expert = torch.cumsum(counts, 0) - counts
    experts_sorted = flat[order]
    position = starts[experts_sorted] + (
        torch.arange(flat.numel(), device=flat.device) - first_of_expert[experts_sorted]
    )
    sorted_slots = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int64, device=flat.device)
    sorted_slots[position] = order
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // BLOCK_M)
    return sorted_slots, block_experts


def _grouped_gemm(a, weights, sorted_slots, block_experts, num_slots, top_k, rows_are_tokens, scale=None):
    num_experts, n, k = weights.shape
    out = torch.empty((num_slots, n), dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    if block_experts.numel():
        _grouped_gemm_kernel[grid](
            a,
            weights,
            out,
            sorted_slots,
            block_experts,
            scale if scale is not None else a,
            num_slots,
            n,
            k,
            a.stride(0),
            weights.stride(0),
            weights.stride(1),
            out.stride(0),
            TOP_K=top_k,
            ROWS_ARE_TOKENS=rows_are_tokens,
            SCALED=scale is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    return out


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    """``x`` [T, H]; ``gate_up`` [E, 2I, H] (gate rows first); ``down`` [E, H, I]; the routing
    [T, k] weights and expert ids: sum over each token's k experts of weight * expert(x)."""
    tokens, top_k = expert_ids.shape
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    num_slots = tokens * top_k
    sorted_slots, block_experts = align_slots(expert_ids, gate_up.shape[0])
    hidden = _grouped_gemm(x, gate_up, sorted_slots, block_experts, num_slots, top_k, rows_are_tokens=True)
    hidden = layer_ops.silu_and_mul(hidden) if hidden.numel() else hidden[:, : hidden.shape[1] // 2]
    scale = routing_weights.reshape(-1).contiguous()
    out = _grouped_gemm(hidden, down, sorted_slots, block_experts, num_slots, top_k, rows_are_tokens=False, scale=scale)
    return out.view(tokens, top_k, -1).sum(dim=1)
