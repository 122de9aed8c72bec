"""The compiled whole-model decoder (kernels/csrc/decode_cpu.cpp) from a DecoderLayout."""

import torch

from kernels.backend import DecoderLayout
from kernels.cpu.dispatch import cpu_flags, gguf_linear_path
from kernels.cpu.linear import CpuLinear


def build_decoder(kernels, layout: DecoderLayout):
    """``kernels.LlamaDecoder`` over the layout's packed weights and KV cache; False where it
    cannot serve it (a projection without the fast path); None before the KV cache is bound."""
    if layout.layers[0][6].numel() == 0:
        return None
    linears = [m for layer in layout.layers for m in layer[2:6]]  # qkv, o, gate_up, down
    if not all(isinstance(m, CpuLinear) and m.fast_path for m in linears):
        return False
    none = torch.empty(0)
    per_layer = []
    for input_norm, post_norm, *projections, k_cache, v_cache in layout.layers:
        tensors = [input_norm, post_norm]
        for linear in projections:
            weight, bias, _ = linear.fast_path
            tensors += [weight, none if bias is None else bias]
        per_layer.append([t.detach() for t in tensors] + [k_cache, v_cache])
    if int8_isa(linears):  # the decoder runs float32 activations only: the layers' path serves
        return False
    return kernels.LlamaDecoder(
        per_layer,
        layout.final_norm.detach(),
        layout.eps,
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        layout.scale,
    )


def int8_isa(linears: list[CpuLinear]) -> str:
    """The integer-dot variant for GGUF blocks in the decoder ("": float32 activations): the
    layers' own choice for a decode step of one token."""
    path = gguf_linear_path(cpu_flags(), 1, linears[0].activations)
    return path[len("int8:") :] if path.startswith("int8:") else ""
