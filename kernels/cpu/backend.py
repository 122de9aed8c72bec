"""``prepare(model)`` for CPU and the backend it returns."""
from typing import Callable

from torch import nn

from kernels.backend import Backend, DecoderLayout
from kernels.cpu import extension
from kernels.cpu.decoder import build_decoder
from kernels.cpu.linear import CpuLinear, pack_linears, swap_linears
from kernels.cpu.memory import move_weights_to_huge_pages, release_freed_memory


def prepare(model: nn.Module, layout_of: Callable[[nn.Module], DecoderLayout | None] | None = None,
            batch_copies: bool = False) -> "CpuBackend":
    """Swap ``model``'s linears for CpuLinears, move its weights into huge pages and pack
    them, in place; the compiled kernels are built or loaded now, not inside the first step.
    ``batch_copies``: GGUF-block layers also get a float32 oneDNN copy for steps of many rows."""
    kernels = extension.load()
    swap_linears(model)
    move_weights_to_huge_pages(model)
    pack_linears(model, kernels, batch_copies)
    release_freed_memory()
    return CpuBackend(model, kernels, layout_of)


class CpuBackend(Backend):
    """Serves decode-only steps of at most ``CpuLinear.FEW_ROWS`` tokens with the compiled
    whole-model decoder (kernels/csrc/decode_cpu.cpp): the same kernels as the model's layers
    without ~270 Python calls per step."""
    name = "cpu"

    def __init__(self, model: nn.Module, kernels, layout_of):
        self.model, self.kernels, self.layout_of = model, kernels, layout_of
        self.layout: DecoderLayout | None = None
        self.decoder = None  # the compiled decoder; False once found unavailable

    def decodes(self, num_tokens: int) -> bool:
        if self.decoder is False or not 0 < num_tokens <= CpuLinear.FEW_ROWS:
            return False
        if self.decoder is None:
            self.decoder = self._build_decoder()
        return bool(self.decoder)

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
        return decoder
