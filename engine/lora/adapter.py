"""PEFT adapters on disk: checked when a request names one, read when it becomes resident.

Supported: plain LoRA (`peft_type` LORA, no bias, no DoRA, no per-module ranks or alphas,
no modules_to_save) on the decoder's projections (q, k, v, o, gate, up, down; on a
mixture-of-experts model the attention's q, k, v, o only), rank up to the engine's
`max_lora_rank`. Scaling is `lora_alpha / r` (`/ sqrt(r)` with rslora), folded
into B when read.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from conveyor.engine.errors import InvalidRequest
from conveyor.engine.lora.request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = TARGETS[:4]  # what a mixture-of-experts model serves (its experts have none)
UNSUPPORTED_KEYS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform")
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # as a job's `lora` (clients/protocol.py)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    targets: tuple[str, ...]


def check_adapter(request: LoRARequest, max_rank: int, targets: tuple[str, ...] = TARGETS) -> AdapterConfig:
    """The adapter's config, or InvalidRequest naming what cannot be served (``targets``:
    the modules the model serves adapters on)."""
    if not isinstance(request, LoRARequest):
        raise InvalidRequest("lora_request", f"must be a LoRARequest, got {type(request).__name__}")
    if isinstance(request.lora_int_id, bool) or not isinstance(request.lora_int_id, int) or request.lora_int_id < 1:
        raise InvalidRequest("lora_request.lora_int_id", f"must be an integer >= 1, got {request.lora_int_id!r}")
    folder = Path(request.lora_path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest("lora_request.lora_path", f"no readable adapter_config.json in {folder}: {exc}") from None
    if not (folder / WEIGHTS_FILE).is_file():
        raise InvalidRequest("lora_request.lora_path", f"{folder} has no {WEIGHTS_FILE}")
    return _parsed(config, max_rank, targets)


def _parsed(config: dict, max_rank: int, served: tuple[str, ...]) -> AdapterConfig:
    if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none":
        raise InvalidRequest("lora_request", "only plain LoRA adapters without bias are supported")
    given = [key for key in UNSUPPORTED_KEYS if config.get(key)]
    if given:
        raise InvalidRequest("lora_request", f"adapter option {given[0]!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise InvalidRequest("lora_request", f"adapter rank {rank!r} is over max_lora_rank ({max_rank})")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(served))
    if unknown:
        where = "" if served == TARGETS else " on this mixture-of-experts model"
        raise InvalidRequest("lora_request", f"target module {unknown[0]!r} is not supported{where} (only {served})")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterConfig(rank, scaling, tuple(targets))


def read_adapter(request: LoRARequest, config: AdapterConfig, dtype: torch.dtype) -> dict:
    """{(layer, target): (A [r, in], B [out, r] times the scaling)} of the adapter."""
    tensors = load_file(str(Path(request.lora_path) / WEIGHTS_FILE))
    weights = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        layer, target = _where(name)
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        weights[(layer, target)] = (a.to(dtype), (b.float() * config.scaling).to(dtype))
    return weights


def _where(name: str) -> tuple[int, str]:
    """(layer index, target) of `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`."""
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1])
    return layer, parts[parts.index("lora_A") - 1]
