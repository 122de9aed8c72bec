"""The compiled whole-model decoder (kernels/csrc/decode_cpu.cpp) from a DecoderLayout."""

import torch

from conveyor.kernels.backend import DecoderLayout
from conveyor.kernels.cpu.linear import CpuLinear


def build_decoder(kernels, layout: DecoderLayout):
    """``kernels.LlamaDecoder`` over the layout's packed weights and KV cache; False where it
    cannot serve it (a projection without the fast path); None before the KV cache is bound."""
    if layout.layers[0][6].numel() == 0:
        return None
    linears = [m for layer in layout.layers for m in layer[2:6]]  # qkv, o, gate_up, down
    if not all(isinstance(m, CpuLinear) and m.fast_path for m in linears):
        return False
    gemm_isa = decoder_gemm_isa(linears)
    if gemm_isa is None:  # int8 activations without the repacked GEMM: the layers' path serves
        return False
    none = torch.empty(0)
    per_layer = []
    for input_norm, post_norm, *projections, k_cache, v_cache in layout.layers:
        tensors, gemm_scales = [input_norm, post_norm], []
        for linear in projections:
            weight, bias, _ = linear.fast_path
            if gemm_isa:
                weight, scales, offsets, _ = linear.int8_gemm
                gemm_scales += [scales, offsets]
            tensors += [weight, none if bias is None else bias]
        per_layer.append([t.detach() for t in tensors] + [k_cache, v_cache] + gemm_scales)
    return kernels.LlamaDecoder(
        per_layer,
        layout.final_norm.detach(),
        layout.eps,
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        layout.scale,
        gemm_isa,
    )


def decoder_gemm_isa(linears: list[CpuLinear]) -> str | None:
    """The GEMM variant the decoder runs its projections with on int8 activations ("": float32
    activations, few_rows_linear; None: int8 activations on a projection without the repacked
    copy, which the decoder does not serve)."""
    if all(m.activations != "int8" for m in linears):
        return ""
    isas = {m.int8_gemm[3] if m.int8_gemm is not None else None for m in linears}
    return isas.pop() if len(isas) == 1 else None
