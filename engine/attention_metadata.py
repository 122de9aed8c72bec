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
class PackedPrefills:
    """The prefill spans as tensors, for a backend that attends to all of them in one launch."""
    starts: torch.Tensor  # [S] first row of each span in the flat batch
    lens: torch.Tensor  # [S] new tokens
    prefix_lens: torch.Tensor  # [S] tokens cached before them
    block_tables: torch.Tensor  # [S, max_blocks] (padding entries: block 0)
    max_len: int  # the longest span (sizes the launch grid)


def pack_prefills(prefills: list[PrefillSpan], device: torch.device) -> PackedPrefills:
    width = max(len(span.block_table) for span in prefills)
    tables = torch.zeros(len(prefills), width, dtype=torch.long, device=device)
    for row, span in enumerate(prefills):
        tables[row, :len(span.block_table)] = span.block_table
    column = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedPrefills(column([s.start for s in prefills]), column([s.end - s.start for s in prefills]),
                          column([s.prefix_len for s in prefills]), tables,
                          max(s.end - s.start for s in prefills))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token
    num_decode_tokens: int = 0  # the first tokens of the batch: one per decoding sequence
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSpan] = field(default_factory=list)
    packed_prefills: PackedPrefills | None = None  # the prefills again, for the Triton backend
