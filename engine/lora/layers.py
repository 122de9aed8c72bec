"""A base projection plus each row's own LoRA adapter: the shrink (x A^T, to the rank) and
expand (. B^T, back to the outputs) matmuls of punica / S-LoRA, done per run of rows that
share an adapter (the rows of one sequence are contiguous in a step: slices, not gathers,
which on CPU cost more than the matmuls themselves).

A packed projection (qkv, gate_up) holds its parts' adapters side by side: A stacks the
parts' A matrices, B is block diagonal, so one shrink and one expand serve all parts."""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """This step's runs of rows per resident adapter slot (set by the manager before the forward)."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, first row, end row)


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str, int, int]],
        in_features: int,
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """``parts``: (target name, first output, outputs) of each projection packed in ``base``."""
        super().__init__()
        self.base, self.parts, self.max_rank, self.batch = base, parts, max_rank, batch
        out_features = sum(size for _, _, size in parts)
        width = len(parts) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's matrices of this projection (by target name) into ``slot``."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, (target, first, size) in enumerate(self.parts):
            if target in weights:
                a, b = weights[target]
                cols = slice(index * self.max_rank, index * self.max_rank + a.shape[0])
                self.lora_a[slot, cols] = a
                self.lora_b[slot, first : first + size, cols] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, start, end in self.batch.runs:
            # x may be a bf16 copy's product (kernels/cpu/linear.py bf16_output): the delta is float
            y[start:end] += (x[start:end].to(self.lora_a.dtype) @ self.lora_a[slot].T) @ self.lora_b[slot].T
        return y
