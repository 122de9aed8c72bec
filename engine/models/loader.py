"""Find a model (local HF directory, .gguf file, or the default SmolLM2), read its config,
build our implementation of its architecture and load its weights."""

import json
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from conveyor.engine.config import DEFAULT_MODEL, GENERATION_CONFIG_MODES
from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.gguf_import import converted_dir, smollm2_gguf
from conveyor.engine.models.gguf_weights import place, read_packed
from conveyor.engine.models.gpt2 import GPT2LMHeadModel
from conveyor.engine.models.llama import LlamaForCausalLM, max_context, rotary_for
from conveyor.engine.models.weights import iter_checkpoint
from conveyor.engine.sampling_params import GENERATION_CONFIG_FIELDS, SamplingDefaults
from conveyor.kernels.cpu.dispatch import cpu_flags, gguf_auto_mode, has_bf16_hardware, int8_dot_isa

log = logging.getLogger(__name__)
QUANTIZATION_MODES = ("auto", "gguf", "gguf_int8", "gguf_bf16", "none")
INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "zeros_", "ones_", "constant_")
_INIT_LOCK = threading.Lock()

ARCHITECTURES = {  # model_type -> (our class, the transformers architecture it mirrors)
    "llama": (LlamaForCausalLM, "LlamaForCausalLM"),
    "mistral": (LlamaForCausalLM, "MistralForCausalLM"),
    "qwen2": (LlamaForCausalLM, "Qwen2ForCausalLM"),
    "qwen3": (LlamaForCausalLM, "Qwen3ForCausalLM"),
    "mixtral": (LlamaForCausalLM, "MixtralForCausalLM"),
    "qwen2_moe": (LlamaForCausalLM, "Qwen2MoeForCausalLM"),
    "qwen3_moe": (LlamaForCausalLM, "Qwen3MoeForCausalLM"),
    "gpt2": (GPT2LMHeadModel, "GPT2LMHeadModel"),
}
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED = "Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-2"
GENERATION_CONFIG_FILE = "generation_config.json"
# The default model's generation config states no sampling field (SmolLM2-135M-Instruct's own
# says none, nor does its GGUF), so it would sample at temperature 1.0: its answers would be
# noise. transformers decodes it greedily (no do_sample in its config) and so does `conveyor
# demo`: that is its default here, where its file states nothing of the kind.
DEFAULT_MODEL_GENERATION = {"temperature": 0.0}


@dataclass
class ModelSpec:
    name: str
    model_dir: Path
    hf_config: object
    model_type: str
    eos_token_ids: set[int]
    max_context: int
    gguf_path: Path | None = None  # the .gguf file the model directory was converted from


def resolve_model_dir(model: str) -> Path:
    return resolve_model(model)[0]


def resolve_model(model: str) -> tuple[Path, Path | None]:
    """The Hugging Face directory of ``model`` and the .gguf file it came from (None: not a GGUF)."""
    if model == DEFAULT_MODEL:
        gguf = smollm2_gguf()
        return converted_dir(gguf), gguf
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path), path
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return converted_dir(ggufs[0]), ggufs[0]
    raise ModelLoadError(
        f"model: {model!r} is not a local Hugging Face directory (config.json + "
        f"*.safetensors), a .gguf file, or {DEFAULT_MODEL!r}"
    )


def load_spec(model: str) -> ModelSpec:
    from transformers import AutoConfig

    model_dir, gguf_path = resolve_model(model)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model: cannot read {model_dir / 'config.json'}: {exc}") from exc
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"model: architecture {model_type!r} is not supported; supported: {SUPPORTED}")
    if gguf_path is not None and model_type in MOE_MODEL_TYPES:
        raise ModelLoadError(f"model: a .gguf {model_type} (mixture of experts) is not supported; use its safetensors")
    context = max_context(hf_config) if model_type != "gpt2" else hf_config.n_positions
    return ModelSpec(model, model_dir, hf_config, model_type, _eos_ids(model_dir, hf_config), context, gguf_path)


def sampling_defaults(model: str, generation_config: str = "auto", model_dir: Path | None = None) -> SamplingDefaults:
    """The defaults of a request's unset sampling fields, as vLLM's ``generation_config``:
    "auto" reads the model's generation_config.json (``model_dir``, else ``model``'s
    directory), "vllm" ignores it (SamplingParams' own defaults), any other value is a folder
    holding a generation_config.json (or that file). Only the fields of
    ``GENERATION_CONFIG_FIELDS`` count; max_new_tokens gives max_tokens."""
    if generation_config == "vllm":
        return SamplingDefaults(source="--generation-config vllm: the model's generation config ignored")
    if generation_config == "auto":
        folder = model_dir if model_dir is not None else resolve_model_dir(model)
        path = folder / GENERATION_CONFIG_FILE
        if not path.exists():
            return SamplingDefaults(source=f"the model has no {GENERATION_CONFIG_FILE}")
    else:
        path = Path(generation_config).expanduser()
        path = path / GENERATION_CONFIG_FILE if path.is_dir() else path
        if not path.is_file():
            raise ModelLoadError(
                f"generation_config: {generation_config!r} is none of {', '.join(GENERATION_CONFIG_MODES)} "
                f"and no folder holding a {GENERATION_CONFIG_FILE} (or that file)"
            )
    config = _read_generation_config(path)
    source = f"{path}"
    if generation_config == "auto" and model == DEFAULT_MODEL and not set(config) & set(GENERATION_CONFIG_FIELDS):
        config = DEFAULT_MODEL_GENERATION  # greedy: see DEFAULT_MODEL_GENERATION
        source = f"{DEFAULT_MODEL}'s own: greedy, as transformers reads its {path}, which states no sampling field"
    return SamplingDefaults.from_generation_config(config, source)


def _read_generation_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"generation_config: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"generation_config: {path} is not a JSON object")
    return config


def native_quantization(spec: ModelSpec, quantization: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the model keeps its GGUF blocks (``quantization``: "auto", "gguf", "gguf_int8",
    "gguf_bf16" or "none"): "gguf" does (a GGUF Llama-family model; the kernels unpack the
    blocks into float32 arithmetic) and holds nothing more; "gguf_int8" too, with integer dots
    on int8 activations where the CPU has them (AVX2 and up: every step, from a copy repacked
    for the GEMM; ``gguf_kernel_mode``); "gguf_bf16" with a bfloat16 copy for steps of many
    rows; "auto" does on CPU in float32, the backend adding what ``dispatch.gguf_auto_mode``
    picks for the CPU (int8 dots with dtype="auto" where the CPU has AVX2, AMX included; else
    a bf16 copy on bf16 hardware or a float32 copy for steps of many rows, docs/performance.md); "none"
    dequantizes everything to ``dtype``."""
    if quantization not in QUANTIZATION_MODES:
        raise ModelLoadError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    if quantization == "none":
        return False
    possible = spec.gguf_path is not None and ARCHITECTURES[spec.model_type][0] is LlamaForCausalLM
    if quantization.startswith("gguf") and not possible:
        raise ModelLoadError(f"quantization={quantization!r} needs a .gguf model of the Llama family")
    if quantization == "auto":
        return possible and device.type == "cpu" and dtype == torch.float32
    return possible


def gguf_kernel_mode(quantization: str, dtype: str = "float32", flags: frozenset[str] | None = None) -> str:
    """How layers kept as GGUF blocks run (kernels/cpu/linear.py ``CpuLinear.pack``) on a CPU
    with ``flags`` (this one's by default); ``dtype``: the one asked ("auto" may take int8
    activations or a bfloat16 copy: ``gguf_auto_mode``). "gguf_bf16" asks the bfloat16 copy
    itself (bf16 hardware only)."""
    flags = cpu_flags() if flags is None else flags
    if quantization == "auto":
        return gguf_auto_mode(flags, dtype)
    if quantization == "gguf_bf16":
        if not has_bf16_hardware(flags):
            raise ModelLoadError("quantization=gguf_bf16 needs a CPU with AVX512-BF16 or AMX (bf16 is emulated here)")
        return "bf16_copy"
    if quantization == "gguf_int8" and int8_dot_isa(flags):
        return "int8"
    return "blocks"


def build_model(
    spec: ModelSpec, max_model_len: int, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> torch.nn.Module:
    """The plain model on ``device``; its backend (kernels.prepare.prepare) readies it further.
    See ``native_quantization`` for ``quantization``: packed GGUF blocks replace the layers
    whose weights have them, and the float32 load skips those checkpoint tensors."""
    cls, architecture = ARCHITECTURES[spec.model_type]
    model = _empty_model(cls, spec, architecture, max_model_len)
    served = set()
    if native_quantization(spec, quantization, dtype, device):
        a = model.arch
        served = place(model, read_packed(spec.gguf_path, a.num_heads, a.num_kv_heads))
        log.info("%s: %d tensors kept as GGUF blocks", spec.gguf_path.name, len(served))
    model.load_weights(iter_checkpoint(spec.model_dir, skip=served.__contains__))
    return model.to(device=device, dtype=dtype).eval()


def _empty_model(cls, spec: ModelSpec, architecture: str, max_model_len: int) -> torch.nn.Module:
    """The model with untouched CPU storage for its weights (built on the meta device, so no
    initialisation writes them: a weight the checkpoint or a packed layer replaces is never
    resident); the one computed buffer, Llama's rotary tables, is built again for real."""
    with torch.device("meta"), _no_parameter_init():
        model = cls(spec.hf_config, architecture, max_model_len)
    model.to_empty(device="cpu")
    if isinstance(model, LlamaForCausalLM):
        model.rotary = rotary_for(spec.hf_config, architecture, max_model_len)
    assert all(name.startswith("rotary.") for name, _ in model.named_buffers()), "a buffer left uninitialised"
    return model


@contextmanager
def _no_parameter_init():
    """Layers skip their random initialisation while this thread builds them: on the meta
    device it writes nothing anyway, but its Python meta kernels import torch._dynamo (over
    a second of every replica start). Other threads keep the real initialisers; the lock keeps
    two builds from nesting their patches."""
    with _INIT_LOCK:
        builder, saved = threading.get_ident(), {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
        for name, original in saved.items():
            setattr(nn.init, name, _skipped_on(builder, original))
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(nn.init, name, original)


def _skipped_on(builder: int, original):
    def init(tensor, *args, **kwargs):
        return tensor if threading.get_ident() == builder else original(tensor, *args, **kwargs)

    return init


def _eos_ids(model_dir: Path, hf_config) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config.json wins over config."""
    value = getattr(hf_config, "eos_token_id", None)
    generation_file = model_dir / "generation_config.json"
    if generation_file.exists():
        value = json.loads(generation_file.read_text()).get("eos_token_id", value)
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}
