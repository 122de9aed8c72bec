"""Reading checkpoint tensors and copying them into our modules (fused projections too)."""
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from engine.errors import ModelLoadError


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face checkpoint: ``*.safetensors`` (sharded too) or ``*.bin``."""
    from safetensors import safe_open
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)
        return
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"model: no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


class WeightLoader:
    """Copies named tensors into a module's parameters.

    ``packed`` maps a checkpoint name fragment to (our fragment, row offset, rows) so that
    e.g. q/k/v projections land in one fused ``qkv_proj`` matrix.
    """

    def __init__(self, module: nn.Module, packed: dict[str, tuple[str, int, int]] | None = None,
                 transposed: tuple[str, ...] = (), ignored: tuple[str, ...] = ()):
        self.params = dict(module.named_parameters())
        self.packed = packed or {}
        self.transposed = transposed
        self.ignored = tuple(ignored)  # name suffixes
        self.filled: set[str] = set()  # our parameter names that received data

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], rename=lambda n: n) -> None:
        for raw_name, tensor in weights:
            name = rename(raw_name)
            if name is None or name.endswith(self.ignored):
                continue
            if any(name.endswith(fragment) for fragment in self.transposed):
                tensor = tensor.t()
            self._copy(name, tensor)

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        for fragment, (fused, offset, rows) in self.packed.items():
            if fragment in name:
                target = name.replace(fragment, fused)
                self._param(target, name).data[offset:offset + rows].copy_(tensor)
                self.filled.add(target)
                return
        param = self._param(name, name)
        if param.shape != tensor.shape:
            raise ModelLoadError(f"weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        self.filled.add(name)

    def check_complete(self, optional: tuple[str, ...] = ()) -> None:
        missing = sorted(set(self.params) - self.filled - set(optional))
        if missing:
            raise ModelLoadError(f"weights: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _param(self, name: str, source: str) -> nn.Parameter:
        if name not in self.params:
            raise ModelLoadError(f"weights: checkpoint tensor {source!r} has no place in this model")
        return self.params[name]
