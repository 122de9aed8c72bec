"""What a device backend is (kernels/prepare.py picks one): the whole-model fast paths it
offers once a model is loaded, and the plain description of a decoder it may run whole.
The model files stay plain modules calling plain layer ops.
"""

from dataclasses import dataclass
from typing import Callable

import torch


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

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states of a decode-only step (one new token per sequence)."""
        raise NotImplementedError
