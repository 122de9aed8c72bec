"""Device backends: what a device does to a model once it is loaded, and the whole-model
fast paths it offers afterwards.

``prepare(model, device)`` is the one entry point, called once by the model runner after
the weights are in place: on CPU it swaps the linears for the fast ones, moves the weights
into huge pages and packs them (kernels/cpu/); elsewhere the model runs as it is, on the
torch reference ops (a GPU backend sits beside the CPU one). The model files stay plain
modules calling plain layer ops.
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class DecoderLayout:
    """A Llama-style decoder (pre-norm, fused qkv and gate_up projections, rotary, paged
    attention) described by plain values, so a backend can run it whole without knowing
    the model's classes. ``layers``: per layer ``(input norm weight, post-attention norm
    weight, qkv, o, gate_up, down, k_cache, v_cache)``, the projections as modules."""
    embed: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    layers: list[tuple]
    final_norm: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class Backend:
    """The torch reference backend (any device): no whole-model fast path."""
    name = "torch"

    def decodes(self, num_tokens: int) -> bool:
        """Whether ``decode`` serves a step of ``num_tokens`` decode-only tokens."""
        return False

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Final hidden states of a decode-only step (one new token per sequence)."""
        raise NotImplementedError


def prepare(model: nn.Module, device: torch.device,
            layout_of: Callable[[nn.Module], DecoderLayout | None] | None = None,
            gguf_mode: str = "blocks") -> Backend:
    """Ready ``model`` (weights loaded, on ``device`` in their final dtype) for ``device``, in
    place, and return its backend. ``layout_of(model)`` describes the model as a decoder the
    backend may run whole (None where it is not one), read once the KV cache is bound.
    ``gguf_mode``: how quantized layers run (CPU: "blocks" on float32 activations, "int8"
    integer dots for few rows, "float32_copy" a dequantized oneDNN copy for many;
    kernels/cpu/linear.py)."""
    if device.type == "cpu":
        from kernels.cpu import prepare as prepare_cpu
        return prepare_cpu(model, layout_of, gguf_mode)
    return Backend()
