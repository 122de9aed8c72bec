"""GGUF-native block-quantized weights (Q4_0, Q4_1, Q8_0): the packed layout, its torch
reference, and the two modules that hold such a weight (a linear layer and an embedding).

Layout (one contiguous stretch per output row, 32-element blocks as in GGUF):

- 4-bit, ``torch.uint8 [N, K/2 + K/32 * 8]``: the K/2 nibble bytes in GGUF's order (block
  byte j holds element j low and j + 16 high), then K/32 float32 scales ``d``, then K/32
  float32 mins ``m``; ``w = d * q + m``. Q4_1 as stored (fp16 ``d``/``m`` widened, exact);
  Q4_0 (``w = d * (q - 8)``) with ``m = -8 d``, which gives the same floats.
- 8-bit, ``torch.int8 [N, K + K/32 * 4]``: the K values, then K/32 float32 scales; ``w = d * q``.

Rows are independent, so fused projections (q|k|v, gate|up) are row concatenations and
llama.cpp's q/k row permutation is a row gather. ``dequantize`` reproduces gguf-py's
float32 dequantization (what transformers loads) exactly: ``d * q`` is exact in float32,
so the one rounding left is the add of ``m``, the same as numpy's.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32
# GGML type ids (gguf.GGMLQuantizationType) this layout holds -> (bytes per block, 4-bit?)
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8
BLOCK_BYTES = {GGML_Q4_0: (18, True), GGML_Q4_1: (20, True), GGML_Q8_0: (34, False)}


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.uint8, torch.int8)


def pack_gguf_blocks(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    """GGUF's raw blocks ``uint8 [N, K/32 * block bytes]`` -> our packed weight (a copy)."""
    block_bytes, four_bit = BLOCK_BYTES[ggml_type]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == GGML_Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    elif ggml_type == GGML_Q4_0:
        m, qs = -8 * d, blocks[..., 2:]
    else:
        m, qs = None, blocks[..., 2:]
    parts = [qs.reshape(rows, -1), d.view(np.uint8).reshape(rows, -1)]
    if four_bit:
        parts.append(m.view(np.uint8).reshape(rows, -1))
    packed = torch.from_numpy(np.concatenate(parts, axis=1))
    return packed if four_bit else packed.view(torch.int8)


def row_bytes(in_features: int, four_bit: bool) -> int:
    blocks = in_features // BLOCK
    return in_features // 2 + blocks * 8 if four_bit else in_features + blocks * 4


def in_features_of(weight: torch.Tensor) -> int:
    """K from a packed weight's row bytes (3/4 K for 4-bit, 9/8 K for 8-bit)."""
    return weight.shape[1] * 4 // 3 if weight.dtype == torch.uint8 else weight.shape[1] * 8 // 9


def dequantize(weight: torch.Tensor, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` (or the chosen rows), bit for bit gguf-py's dequantization."""
    in_features = in_features_of(weight)
    if rows is not None:
        weight = weight[rows]
    n, blocks = weight.shape[0], in_features // BLOCK
    raw = weight.view(torch.uint8)
    four_bit = weight.dtype == torch.uint8
    values = in_features // 2 if four_bit else in_features
    d = raw[:, values : values + 4 * blocks].contiguous().view(torch.float32)[..., None]
    if four_bit:
        m = raw[:, values + 4 * blocks :].contiguous().view(torch.float32)[..., None]
        nibbles = raw[:, :values].reshape(n, blocks, 16)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        return (d * q + m).reshape(n, in_features)
    q = weight[:, :values].reshape(n, blocks, BLOCK).float()
    return (d * q).reshape(n, in_features)


def repack_for_int8_gemm(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed weight as kernels/csrc/int8_gemm_cpu.cpp reads it: (values uint8 ``[N/16, K/32,
    256 or 512]``, scales and offsets float16 ``[N/16, K/32, 16]``: GGUF's own half-precision
    values, exactly); per block w = d u + o with u unsigned (4-bit: q, o = the min; 8-bit:
    q + 128, o = -128 d), exactly. N a multiple of 16."""
    in_features, n = in_features_of(weight), weight.shape[0]
    assert n % 16 == 0, n
    groups, blocks = n // 16, in_features // BLOCK
    raw = weight.view(torch.uint8)
    four_bit = weight.dtype == torch.uint8
    values = in_features // 2 if four_bit else in_features
    d = raw[:, values : values + 4 * blocks].contiguous().view(torch.float32)
    if four_bit:
        offsets = raw[:, values + 4 * blocks :].contiguous().view(torch.float32)
        nibbles = raw[:, :values].reshape(n, blocks, 16)
        u = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # element order
        # byte t of lane c in vector i: u[4i + t] low, u[16 + 4i + t] high
        u = u[..., :16] | (u[..., 16:] << 4)
        lanes = 4
    else:
        offsets = -128 * d
        u = (weight[:, :values].to(torch.int16) + 128).to(torch.uint8).reshape(n, blocks, BLOCK)
        lanes = 8
    # [groups, 16 columns, blocks, vectors, 4] -> [groups, blocks, vectors, 16 columns, 4]
    u = u.reshape(groups, 16, blocks, lanes, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, lanes * 64)

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(groups, 16, blocks).transpose(1, 2).contiguous().half()  # exact: they were float16

    return u.contiguous(), per_group(d), per_group(offsets)


def _packed_parameter(weight: torch.Tensor) -> nn.Parameter:
    return weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)


class QuantLinear(nn.Module):
    """``x @ W^T + b`` with W packed (see the module docstring); the torch reference
    dequantizes per call. The CPU backend swaps it for its compiled path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = _packed_parameter(weight)
        self.bias = bias
        self.in_features, self.out_features = in_features_of(weight), weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight).to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class QuantEmbedding(nn.Module):
    """An embedding table held packed; a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = _packed_parameter(weight)
        self.embedding_dim = in_features_of(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
