"""Per-step description of where each token's attention reads and writes in the paged cache."""
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """Tokens ``[start, end)`` of the flat batch: one sequence's prompt chunk."""
    start: int
    end: int
    prefix_len: int  # tokens of this sequence already cached before the chunk
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token
    num_decode_tokens: int = 0  # the first tokens of the batch: one per decoding sequence
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSpan] = field(default_factory=list)
