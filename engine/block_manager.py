"""KV block accounting (no tensors): a preallocated pool, free list, reference counts."""
from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_missing_blocks(seq, num_tokens) + reserve <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Append blocks to ``seq.block_table`` to hold ``num_tokens``; returns the new ids."""
        needed = self.num_missing_blocks(seq, num_tokens)
        assert needed <= self.num_free_blocks, "caller must check can_grow first"
        new_ids = [self.free_block_ids.popleft() for _ in range(needed)]
        for block_id in new_ids:
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1
        seq.block_table.extend(new_ids)
        return new_ids

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
