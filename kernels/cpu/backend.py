"""``prepare(model)`` for CPU and the backend it returns."""

from typing import Callable

import torch
from torch import nn

from conveyor.kernels.backend import Backend, DecoderLayout
from conveyor.kernels.cpu import extension
from conveyor.kernels.cpu.decoder import build_decoder
from conveyor.kernels.cpu.linear import CpuLinear, pack_linears, swap_linears
from conveyor.kernels.cpu.memory import move_weights_to_huge_pages, release_freed_memory


def prepare(
    model: nn.Module, layout_of: Callable[[nn.Module], DecoderLayout | None] | None = None, gguf_mode: str = "blocks"
) -> "CpuBackend":
    """Swap ``model``'s linears for CpuLinears, move its weights into huge pages and pack
    them, in place; the compiled kernels are built or loaded now, not inside the first step.
    ``gguf_mode``: how GGUF-block layers run (``CpuLinear.pack``)."""
    kernels = extension.load()
    swap_linears(model)
    pack_linears(model, kernels, gguf_mode)  # first: the weights it releases are never moved
    move_weights_to_huge_pages(model)
    release_freed_memory()
    return CpuBackend(model, kernels, layout_of)


class CpuBackend(Backend):
    """Serves decode-only steps with the compiled whole-model decoder
    (kernels/csrc/decode_cpu.cpp): the same kernels as the model's layers without ~270
    Python calls per step, for as many tokens as its kernels are the layers' own:
    ``CpuLinear.FEW_ROWS`` over float32 weights, the projections' ``blocks_max_rows`` over GGUF
    blocks (whose few-row kernel serves the layers up to there too; a speculative step verifying
    drafts is a few decode tokens per sequence)."""

    name = "cpu"

    def __init__(self, model: nn.Module, kernels, layout_of):
        self.model, self.kernels, self.layout_of = model, kernels, layout_of
        self.layout: DecoderLayout | None = None
        self.decoder = None  # the compiled decoder; False once found unavailable
        self.max_tokens = CpuLinear.FEW_ROWS

    def decodes(self, num_tokens: int) -> bool:
        if self.decoder is None:
            self.decoder = self._build_decoder()
        return bool(self.decoder) and 0 < num_tokens <= self.max_tokens

    def decode(self, input_ids, positions, slot_mapping, block_tables, context_lens):
        layout = self.layout
        x = layout.embed(input_ids)
        cos, sin = (t.reshape(x.shape[0], -1) for t in layout.rotary(positions))
        return self.decoder.forward(x, cos, sin, slot_mapping, block_tables, context_lens)

    def _build_decoder(self):
        """The decoder; False where it cannot serve this model; None before the KV cache is bound."""
        layout = self.layout_of(self.model) if self.layout_of is not None and self.kernels is not None else None
        if layout is None:
            return False
        decoder = build_decoder(self.kernels, layout)
        if decoder:
            self.layout = layout
            projections = [m for layer in layout.layers for m in layer[2:6]]
            if all(m.fast_path[0].dtype is not torch.float32 for m in projections):
                self.max_tokens = min(m.blocks_max_rows for m in projections)
        return decoder
