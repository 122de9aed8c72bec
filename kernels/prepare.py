"""``prepare(model, device)``: the one entry point of the device backends, called once by
the model runner after the weights are in place. On CPU it swaps the linears for the fast
ones, moves the weights into huge pages and packs them (kernels/cpu/); elsewhere the model
runs as it is, on the torch reference ops (kernels/backend.py). It stands above the
backends it chooses from, which import only kernels/backend.py's types."""

from typing import Callable

import torch
from torch import nn

from conveyor.kernels.backend import Backend, DecoderLayout


def prepare(
    model: nn.Module,
    device: torch.device,
    layout_of: Callable[[nn.Module], DecoderLayout | None] | None = None,
    gguf_mode: str = "blocks",
) -> Backend:
    """Ready ``model`` (weights loaded, on ``device`` in their final dtype) for ``device``, in
    place, and return its backend. ``layout_of(model)`` describes the model as a decoder the
    backend may run whole (None where it is not one), read once the KV cache is bound.
    ``gguf_mode``: how quantized layers run (CPU: "blocks" on float32 activations, "int8"
    integer dots for few rows, "float32_copy" a dequantized oneDNN copy for many;
    kernels/cpu/linear.py)."""
    if device.type == "cpu":
        from conveyor.kernels.cpu import prepare as prepare_cpu

        return prepare_cpu(model, layout_of, gguf_mode)
    return Backend()
