"""Find a model (local HF directory, .gguf file, or the default SmolLM2), read its config,
build our implementation of its architecture and load its weights."""
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL
from engine.errors import ModelLoadError
from engine.models.gguf_import import converted_dir, smollm2_gguf
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM, max_context
from engine.models.weights import iter_checkpoint

ARCHITECTURES = {  # model_type -> (our class, the transformers architecture it mirrors)
    "llama": (LlamaForCausalLM, "LlamaForCausalLM"),
    "mistral": (LlamaForCausalLM, "MistralForCausalLM"),
    "qwen2": (LlamaForCausalLM, "Qwen2ForCausalLM"),
    "qwen3": (LlamaForCausalLM, "Qwen3ForCausalLM"),
    "gpt2": (GPT2LMHeadModel, "GPT2LMHeadModel"),
}
SUPPORTED = "Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, GPT-2"


@dataclass
class ModelSpec:
    name: str
    model_dir: Path
    hf_config: object
    model_type: str
    eos_token_ids: set[int]
    max_context: int


def resolve_model_dir(model: str) -> Path:
    if model == DEFAULT_MODEL:
        return converted_dir(smollm2_gguf())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return converted_dir(ggufs[0])
    raise ModelLoadError(f"model: {model!r} is not a local Hugging Face directory (config.json + "
                         f"*.safetensors), a .gguf file, or {DEFAULT_MODEL!r}")


def load_spec(model: str) -> ModelSpec:
    from transformers import AutoConfig
    model_dir = resolve_model_dir(model)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model: cannot read {model_dir / 'config.json'}: {exc}") from exc
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"model: architecture {model_type!r} is not supported; supported: {SUPPORTED}")
    context = max_context(hf_config) if model_type != "gpt2" else hf_config.n_positions
    return ModelSpec(model, model_dir, hf_config, model_type, _eos_ids(model_dir, hf_config), context)


def build_model(spec: ModelSpec, max_model_len: int, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    """The plain model on ``device``; its backend (kernels.backend.prepare) readies it further."""
    cls, architecture = ARCHITECTURES[spec.model_type]
    with torch.device("cpu"):
        model = cls(spec.hf_config, architecture, max_model_len)
    model.load_weights(iter_checkpoint(spec.model_dir))
    return model.to(device=device, dtype=dtype).eval()


def _eos_ids(model_dir: Path, hf_config) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config.json wins over config."""
    value = getattr(hf_config, "eos_token_id", None)
    generation_file = model_dir / "generation_config.json"
    if generation_file.exists():
        value = json.loads(generation_file.read_text()).get("eos_token_id", value)
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}
