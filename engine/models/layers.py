"""Building blocks shared by the model families: norms, rotary embedding, paged attention."""
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.models.cpu_memory import huge_page_copies
from kernels import cpu_extension
from kernels.attention import paged_decode_attention, prefill_attention, write_kv_cache
from kernels.layer_ops import add_rms_norm, rms_norm, rotary_and_cache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, ``(norm(residual + x), residual + x)`` (the inputs'
        storage may be reused)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``; ``inv_freq`` comes from
    transformers' own rope initialisers, so every rope type it defines means the same here."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, D]`` for a step's positions (looked up once, used by every layer)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


class PagedAttention(nn.Module):
    """Writes this step's keys/values into the layer's cache, then attends over it.
    The runner binds ``k_cache``/``v_cache`` after allocating the pool."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """With ``cos_sin``, ``q`` and ``k`` get the rotary embedding first."""
        if cos_sin is None:
            write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            q, k = rotary_and_cache(q, k, v, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, meta)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], meta)
        for span in meta.prefills:
            rows = slice(span.start, span.end)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], self.k_cache, self.v_cache,
                                          span.block_table, span.prefix_len, self.scale)
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                      meta.decode_context_lens, self.scale)


class CpuLinear(nn.Module):
    """``x @ W^T + b`` on CPU float32, on the fastest path for the number of rows of ``x``:

    - at most ``FEW_ROWS`` (single-stream decode): the compiled kernel, which streams the
      weight once at nearly the machine's read bandwidth, from a row-interleaved copy
      (``interleave_rows``: each group of 16 rows one contiguous stretch) where the
      shapes allow it (multiples of 16);
    - more: oneDNN on a copy of the weight packed in its blocked layout (``pack()``), 1.3-2.5x
      MKL's sgemm from 4 rows up to prefill chunks; without oneDNN, MKL on the plain weight.
      With the interleaved copy the matmul weights are held three times. oneDNN compiles and caches a kernel
      per input shape (~0.5 MB each), so rows are padded up to a few bucket sizes
      (``row_bucket``): a bounded set of shapes instead of one per batch size seen.

    Shares the weight it wraps (a tied head shares the embedding table)."""

    FEW_ROWS = 2  # crossover measured on a 2-core AVX-512 machine (benchmarks/cpu_speed.py)
    PACK_BATCH_HINT = 64  # rows oneDNN tunes the blocked layout for

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.kernels = cpu_extension.load()
        # (few-row weight, bias, oneDNN-packed weight or None) as plain attributes, from pack()
        self.fast_path: tuple | None = None

    def pack(self, interleaved: torch.Tensor | None = None) -> None:
        """Make the oneDNN copy and take the few-row kernel's ``interleaved`` copy (see
        ``pack_cpu_linears``); call once the weight has its final dtype and place."""
        if self.weight.dtype != torch.float32:
            return
        packed = None
        if torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.PACK_BATCH_HINT)
            except (AttributeError, RuntimeError):  # a torch build without the op: MKL it is
                packed = None
        # nn.Module resolves parameters through __getattr__; a decode step reads them ~600 times
        few_rows_weight = self.weight if interleaved is None else interleaved
        self.fast_path = (few_rows_weight, self.bias, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_path is None or x.dim() != 2 or x.dtype is not torch.float32:
            return F.linear(x, self.weight, self.bias)
        weight, bias, packed = self.fast_path
        if self.kernels is not None and x.shape[0] <= self.FEW_ROWS:
            return self.kernels.few_rows_linear(x, weight, bias)
        if packed is not None:
            rows = x.shape[0]
            padded = row_bucket(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
        return F.linear(x, weight, bias)


def row_bucket(rows: int) -> int:
    """Rows rounded up to a multiple of 8 (up to 64), 32 (up to 512), then 128: at most
    ~8 + 14 + budget/128 shapes, wasting under a third of a step's rows at worst (65 -> 96)
    and nothing on full 512-token prefill chunks."""
    step = 8 if rows <= 64 else 32 if rows <= 512 else 128
    return -(-rows // step) * step


def use_cpu_linears(model: nn.Module) -> None:
    """Swap every nn.Linear (and tied head) for a CpuLinear, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, CpuLinear(child.weight, child.bias))
        elif isinstance(child, TiedHead):
            setattr(model, name, CpuLinear(child.embedding[0].weight, None))
        else:
            use_cpu_linears(child)


def pack_cpu_linears(model: nn.Module) -> None:
    """Every CpuLinear's oneDNN copy, and its row-interleaved copy for the few-row kernel
    (all in one huge-page arena) where the kernels support it and the shape allows."""
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    kernels = cpu_extension.load()
    can_interleave = kernels is not None and kernels.interleaved_supported()
    interleavable = [m for m in linears if can_interleave and m.weight.dtype == torch.float32
                     and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0]
    copies = huge_page_copies([kernels.interleave_rows(m.weight.detach()) for m in interleavable])
    interleaved = {id(m): copy for m, copy in zip(interleavable, copies)}
    for module in linears:
        module.pack(interleaved.get(id(module)))


class TiedHead(nn.Module):
    """Output projection that reuses the input embedding matrix."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = [embedding]  # a list: not registered twice as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embedding[0].weight)
