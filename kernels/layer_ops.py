"""The per-token operations between a decoder layer's matmuls: RMSNorm (with the residual
add folded in), SiLU-and-multiply, and rotary embedding fused with the KV-cache write.

Each has a torch reference (any device, any dtype; the op order transformers uses, so
float32 results match it bit for bit) and, for CPU float32, one compiled call in place of
the several torch ops whose dispatch dominates a decode step.
"""

import torch
import torch.nn.functional as F

from conveyor.kernels.attention import KV_CACHE_DTYPES, write_kv_cache
from conveyor.kernels.cpu.extension import for_tensors as _compiled

_triton = None  # kernels.triton.layer_ops once a CUDA engine chose the Triton backend


def use_triton_on_cuda() -> None:
    """From now on CUDA tensors take the fused Triton norms and SiLU-and-mul (process-wide:
    the kernels are exact stand-ins for the reference, so sharing the switch is harmless)."""
    global _triton
    from conveyor.kernels.triton import layer_ops

    _triton = layer_ops


def _fused(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the Triton kernels: rows ``[T, features]`` on CUDA, once switched on."""
    return _triton is not None and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1


def fused_moe_ready(x: torch.Tensor) -> bool:
    """Whether a mixture-of-experts layer's experts on ``x`` run as kernels/triton/moe.py's
    grouped GEMMs (CUDA with the Triton backend), rather than one linear per expert."""
    return _fused(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused(x):
        return _triton.rms_norm(x, weight, eps)
    kernels = _compiled(x, weight)
    if kernels is not None and x.dim() == 2 and x.is_contiguous():
        return kernels.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` (the new residual stream) and its RMSNorm. May reuse the storage of
    both inputs, which the caller must not read again. On CPU ``x`` may be bfloat16 (a bf16
    copy's product, kernels/cpu/linear.py): the compiled kernel adds it to the float32 stream
    and writes the norm back into it, as bf16 for the next bf16 matmul."""
    if _fused(x) and residual.stride(-1) == 1:
        return _triton.add_rms_norm(x, residual, weight, eps)
    kernels = _compiled(x, dtypes=(torch.float32, torch.bfloat16)) and _compiled(residual, weight)
    if kernels is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
        kernels.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows laid out ``[gate | up]``; on CPU the compiled kernel takes
    bfloat16 too (a bf16 copy's product, kernels/cpu/linear.py), in float32 arithmetic."""
    if _fused(gate_up):
        return _triton.silu_and_mul(gate_up)
    kernels = _compiled(gate_up, dtypes=(torch.float32, torch.bfloat16))
    if kernels is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q``/``k`` ``[T, heads, D]``, then ``k``/``v`` stored at
    ``slot_mapping``. Returns the rotated ``q`` and ``k`` (rotated in place where compiled)."""
    cos, sin = cos_sin
    kernels = _compiled(q, k, v, cos) and _compiled(k_cache, dtypes=KV_CACHE_DTYPES)
    if kernels is not None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        kernels.rotary_and_cache_(
            q, k, v, cos.reshape(q.shape[0], -1), sin.reshape(q.shape[0], -1), k_cache, v_cache, slot_mapping
        )
        return q, k
    q, k = apply_rotary(q, k, cos_sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    """``q``/``k`` ``[T, heads, D]``; ``cos``/``sin`` ``[T, 1, D]``."""
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
