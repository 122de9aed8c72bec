"""Building blocks shared by the model families: norms, rotary embedding, paged attention."""

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention_metadata import AttentionMetadata
from conveyor.kernels.attention import paged_decode_attention, prefill_attention, write_kv_cache
from conveyor.kernels.layer_ops import add_rms_norm, rms_norm, rotary_and_cache


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
    The runner binds ``k_cache``/``v_cache`` after allocating the pool, and ``triton`` (the
    kernels.triton.attention module) when it selected the Triton attention backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.triton = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """With ``cos_sin``, ``q`` and ``k`` get the rotary embedding first."""
        if self.triton is not None:
            return self._forward_triton(q, k, v, meta, cos_sin)
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
            out[rows] = prefill_attention(
                q[rows], k[rows], v[rows], self.k_cache, self.v_cache, span.block_table, span.prefix_len, self.scale
            )
        return out

    def _forward_triton(self, q, k, v, meta: AttentionMetadata, cos_sin) -> torch.Tensor:
        kernels = self.triton
        if cos_sin is not None:
            q, k = kernels.rotary(q, k, cos_sin)
        kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
            )
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = kernels.paged_decode_attention(
                q[:num_decode],
                self.k_cache,
                self.v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
            )
        packed = meta.packed_prefills
        kernels.prefill_attention_varlen(
            q,
            self.k_cache,
            self.v_cache,
            out,
            packed.starts,
            packed.lens,
            packed.prefix_lens,
            packed.block_tables,
            packed.max_len,
            self.scale,
            exact=q.dtype == torch.float32,
        )
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return paged_decode_attention(
            q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
        )


class TiedHead(nn.Module):
    """Output projection that reuses the input embedding matrix."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = [embedding]  # a list: not registered twice as a submodule

    @property
    def tied_weight(self) -> torch.Tensor:
        return self.embedding[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.tied_weight)
