"""Fused Triton versions of the per-token ops between a layer's matmuls (the torch
references are in kernels/layer_ops.py, whose op order, float32 inside and roundings to
the input dtype where torch rounds, these follow): RMSNorm with the residual add folded in,
SiLU-and-mul, and rotary embedding applied in place (any rope type: the cos/sin tables come
from transformers' own initialisers, llama3 scaling included)."""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import interpreted

ROWS_PER_PROGRAM = 64 if interpreted() else 1  # the interpreter's cost is per program


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    new_residual,
    rows,
    stride_x,
    stride_r,
    stride_o,
    stride_n,
    eps,
    COLS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ADD: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < COLS)
    value = tl.load(x + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    if ADD:  # residual + x, rounded to the stream's dtype as torch's add would
        value = (
            value.to(tl.float32)
            + tl.load(residual + r[:, None] * stride_r + c[None, :], mask=mask, other=0.0).to(tl.float32)
        ).to(x.dtype.element_ty)
        tl.store(new_residual + r[:, None] * stride_n + c[None, :], value, mask=mask)
    v = value.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / COLS + eps)
    normed = (v * inv[:, None]).to(x.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + c, mask=c < COLS, other=0.0).to(tl.float32)
    tl.store(out + r[:, None] * stride_o + c[None, :], (w[None, :] * normed).to(out.dtype.element_ty), mask=mask)


def _norm(x, residual, weight, eps):
    rows, cols = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else x
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            rows,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0),
            eps,
            COLS=cols,
            BLOCK_C=triton.next_power_of_2(cols),
            BLOCK_R=ROWS_PER_PROGRAM,
            ADD=residual is not None,
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[rows, cols]``."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)`` in one pass over the rows."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(
    gate_up, out, rows, stride_in, stride_out, COLS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < COLS)
    gate = tl.load(gate_up + r[:, None] * stride_in + c[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + r[:, None] * stride_in + COLS + c[None, :], mask=mask, other=0.0)
    # silu rounded to the dtype, then the product, as torch's two ops round
    silu = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + r[:, None] * stride_out + c[None, :], (silu * up.to(tl.float32)).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate | up]`` ``[rows, 2 * cols]``."""
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block_c = min(triton.next_power_of_2(cols), 4096 if interpreted() else 1024)
    if rows:
        _silu_and_mul_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(cols, block_c))](
            gate_up, out, rows, gate_up.stride(0), out.stride(0), COLS=cols, BLOCK_C=block_c, BLOCK_R=ROWS_PER_PROGRAM
        )
    return out


@triton.jit
def _rotary_kernel(
    x,
    cos,
    sin,
    tokens,
    stride_t,
    stride_h,
    stride_cos,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h, d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    mask = (t[:, None, None] < tokens) & (h[None, :, None] < HEADS) & (d[None, None, :] < HALF)
    table_mask = (t[:, None] < tokens) & (d[None, :] < HALF)
    # cos/sin rows repeat their first half (emb = cat(freqs, freqs)), so half a row suffices
    c = tl.load(cos + t[:, None] * stride_cos + d[None, :], mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(sin + t[:, None] * stride_cos + d[None, :], mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    first = x + t[:, None, None] * stride_t + h[None, :, None] * stride_h + d[None, None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(x.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(x.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, D]`` in place; ``cos``/``sin`` ``[T, D]`` (the
    model's tables looked up at the step's positions, any strides but the last)."""
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    if tokens:
        per_program = 64 if interpreted() else 4
        _rotary_kernel[(triton.cdiv(tokens, per_program),)](
            x,
            cos,
            sin,
            tokens,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HEADS=heads,
            HALF=dim // 2,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(dim // 2),
            BLOCK_T=per_program,
        )
    return x
