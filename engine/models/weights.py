"""Reading checkpoint tensors and copying them into our modules (fused projections too)."""

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from conveyor.engine.errors import ModelLoadError


def iter_checkpoint(model_dir: Path, skip=lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face checkpoint: ``*.safetensors`` (sharded too) or ``*.bin``;
    names ``skip`` accepts are not read (safetensors) or not yielded."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as shard:
                    for name in shard.keys():
                        if not skip(name):
                            yield name, shard.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(f"weights: cannot read {file.name}: {exc}") from exc
        return
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"model: no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for file in files:
        yield from ((n, t) for n, t in torch.load(file, map_location="cpu", weights_only=True).items() if not skip(n))


class WeightLoader:
    """Copies named tensors into a module's parameters.

    ``packed`` maps a checkpoint name fragment to (our fragment, row offset, rows) so that
    e.g. q/k/v projections land in one fused ``qkv_proj`` matrix; an optional fourth item,
    a predicate of our parameter names, says which fused parameters that fragment fills
    (a MoE model's experts have fused projections of other widths than its dense layers).
    """

    def __init__(
        self,
        module: nn.Module,
        packed: dict[str, tuple[str, int, int]] | None = None,
        transposed: tuple[str, ...] = (),
        ignored: tuple[str, ...] = (),
    ):
        # packed GGUF blocks (integer parameters) arrive whole before the float load
        self.params = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
        self.packed = packed or {}
        self.transposed = transposed
        self.ignored = tuple(ignored)  # name suffixes
        self.filled: set[str] = set()  # our parameter names (or "fused#part") that received data

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], rename=lambda n: n) -> None:
        for raw_name, tensor in weights:
            name = rename(raw_name)
            if name is None or name.endswith(self.ignored):
                continue
            if any(name.endswith(fragment) for fragment in self.transposed):
                tensor = tensor.t()
            self._copy(name, tensor)

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        for fragment, (fused, offset, rows, *_) in self.packed.items():
            if fragment in name:
                target = name.replace(fragment, fused)
                self._fill(self._param(target, name).data[offset : offset + rows], tensor, name)
                self.filled.add(f"{target}#{fragment}")
                return
        self._fill(self._param(name, name).data, tensor, name)
        self.filled.add(name)

    def check_complete(self) -> None:
        """Every parameter, and every part of a fused one, must have come from the checkpoint."""
        missing = sorted(self._required() - self.filled)
        if missing:
            raise ModelLoadError(f"weights: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _required(self) -> set[str]:
        required = set()
        for name in self.params:
            parts = [
                f"{name}#{fragment}"
                for fragment, (fused, _, _, *applies) in self.packed.items()
                if f".{fused}." in f".{name}" and all(test(name) for test in applies)
            ]
            required.update(parts or [name])
        return required

    @staticmethod
    def _fill(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if target.shape != tensor.shape:
            raise ModelLoadError(f"weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    def _param(self, name: str, source: str) -> nn.Parameter:
        if name not in self.params:
            raise ModelLoadError(f"weights: checkpoint tensor {source!r} has no place in this model")
        return self.params[name]
