"""The Triton attention backend as the model's attention layer calls it (engine/models/
layers.py ``PagedAttention``, when the runner selected ``attention_backend="triton"``):
rotary in place, the cache write, one decode launch for the step's decode rows and one
varlen prefill launch for all its prompt spans."""

import torch

from conveyor.kernels.triton.cache_write import write_kv_cache
from conveyor.kernels.triton.decode_attention import paged_decode_attention
from conveyor.kernels.triton.layer_ops import rotary_
from conveyor.kernels.triton.prefill_attention import prefill_attention_varlen

__all__ = ["write_kv_cache", "paged_decode_attention", "prefill_attention_varlen", "rotary"]


def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    """Rotary embedding of ``q`` and ``k`` ``[T, heads, D]`` in place; ``cos``/``sin`` ``[T, 1, D]``."""
    cos, sin = (t.reshape(t.shape[0], -1) for t in cos_sin)
    return rotary_(q, cos, sin), rotary_(k, cos, sin)
