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


def pack_prefills(prefills: list[PrefillSpan], block_tables: list[list[int]], device: torch.device) -> PackedPrefills:
    """``block_tables``: each span's table as host ints. Built on the host and copied once
    (from pinned memory on CUDA: no wait on the device)."""
    width = max(map(len, block_tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    columns = torch.tensor(
        [[s.start for s in prefills], [s.end - s.start for s in prefills], [s.prefix_len for s in prefills]],
        dtype=torch.long,
    )
    if device.type == "cuda":
        tables, columns = tables.pin_memory(), columns.pin_memory()
    tables, columns = tables.to(device, non_blocking=True), columns.to(device, non_blocking=True)
    return PackedPrefills(columns[0], columns[1], columns[2], tables, max(s.end - s.start for s in prefills))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token
    num_decode_tokens: int = 0  # the first tokens of the batch: one per decoding sequence
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillSpan] = field(default_factory=list)
    packed_prefills: PackedPrefills | None = None  # the prefills again, for the Triton backend
