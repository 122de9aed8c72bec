"""GGUF-native weights: the Q4_0, Q4_1 and Q8_0 tensors of a .gguf file, read as they are
stored (no float32 copy) and placed into a Llama-family model as packed layers
(kernels/quant.py). Every other tensor (norms, biases, other quantization types) keeps the
dequantized path through the converted checkpoint.

Names and rows follow transformers' own GGUF loader, so the dequantized values are exactly
the tensors of the converted checkpoint: llama.cpp stores the q/k rows of "llama"-arch
files permuted for its rotary layout, and transformers permutes them back (a row gather,
which block quantization survives since blocks run along rows).
"""

import logging
import mmap
import re
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conveyor.kernels.quant import BLOCK, BLOCK_BYTES, QuantEmbedding, QuantLinear, pack_gguf_blocks

log = logging.getLogger(__name__)
LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight$")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # GGUF general.architecture values we map


def hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = LAYER.match(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.weight"
    return None


def read_packed(gguf_path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """HF tensor name -> packed weight, for every Q4_0/Q4_1/Q8_0 tensor we can place; empty
    for an architecture we do not map."""
    with open(gguf_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        arch, tensors = read_header(data)
        if arch not in ARCHITECTURES:
            log.info("GGUF architecture %r: no native quantized weights", arch)
            return {}
        packed = {}
        for gguf_name, (shape, ggml_type, offset) in tensors.items():
            name = hf_name(gguf_name)
            if name is None or ggml_type not in BLOCK_BYTES or len(shape) != 2 or shape[0] % BLOCK:
                continue
            block_bytes = BLOCK_BYTES[ggml_type][0]
            rows, width = shape[1], shape[0] // BLOCK * block_bytes  # GGUF shapes: innermost first
            raw = np.frombuffer(data, np.uint8, rows * width, offset).reshape(rows, width)
            if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                raw = raw[_unpermuted_rows(rows, num_heads if ".attn_q." in gguf_name else num_kv_heads)]
            packed[name] = pack_gguf_blocks(raw, ggml_type)
            del raw  # no view of the map may outlive it
        return packed


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(data) -> tuple[str, dict[str, tuple[list[int], int, int]]]:
    """A GGUF file's architecture and its tensors: name -> (shape, ggml type, absolute offset).
    (gguf-py's reader builds every metadata field as numpy views, ~10 s for a 49k vocabulary.)"""
    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} unsupported")
    pos, fields = 24, {}

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return bytes(data[at + 8 : at + 8 + length]).decode("utf-8", "replace"), at + 8 + length

    def value(kind: int, at: int):
        if kind == 8:
            return string(at)
        if kind == 9:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _SCALARS:  # arrays of numbers are skipped, never read
                return None, at + count * struct.calcsize("<" + _SCALARS[item])
            for _ in range(count):
                _, at = value(item, at)
            return None, at
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        fields[key], pos = value(kind, pos + 4)
    infos = {}
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", data, pos)
        shape = list(struct.unpack_from(f"<{dims}Q", data, pos + 4))
        ggml_type, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * dims)
        infos[name] = (shape, ggml_type, offset)
        pos += 4 + 8 * dims + 12
    alignment = fields.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    return fields.get("general.architecture") or "", {n: (s, t, start + o) for n, (s, t, o) in infos.items()}


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """transformers' _reverse_permute_weights as a row index."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def place(model: nn.Module, packed: dict[str, torch.Tensor]) -> set[str]:
    """Replace the model's linears/embedding whose weights are all packed (fused projections
    need every part, all 4-bit or all 8-bit) by QuantLinear/QuantEmbedding, in place; returns
    the checkpoint names now served, which the float32 load must skip."""
    served = set()
    for module_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            leaf = module_name.rsplit(".", 1)[-1]
            parts = (
                [f"{module_name.rsplit('.', 1)[0]}.{p}.weight" for p in FUSED[leaf]]
                if leaf in FUSED
                else [f"{module_name}.weight"]
            )
            if all(p in packed for p in parts) and len({packed[p].dtype for p in parts}) == 1:
                weight = torch.cat([packed[p] for p in parts]) if len(parts) > 1 else packed[parts[0]]
                if weight.shape[0] == module.out_features:
                    _set(model, module_name, QuantLinear(weight, module.bias))
                    served.update(parts)
        elif isinstance(module, nn.Embedding) and f"{module_name}.weight" in packed:
            _set(model, module_name, QuantEmbedding(packed[f"{module_name}.weight"]))
            served.add(f"{module_name}.weight")
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        isinstance(embed, QuantEmbedding)
        and getattr(model, "lm_head", None) is not None
        and not isinstance(model.lm_head, (nn.Linear, QuantLinear))
    ):  # tied head: the same blocks
        model.lm_head = QuantLinear(embed.weight)
    return served


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
