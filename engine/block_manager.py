"""KV block accounting (no tensors): a preallocated pool, reference counts, and a prefix
cache of full blocks.

A full block is identified by a sha256 chained over its tokens (its parent block's digest
and its own token ids), the first block's parent being a root digest of the adapter and the
request's cache salt: equal prefixes under the same weights and salt map to equal chains,
and a prefix of one salt (a replica salts each namespace's requests with its name) is never
served to another. A hit is also checked against the block's recorded parent and tokens, so
not even a digest collision serves a block to tokens it does not hold. (Python's built-in
tuple hash, used before, is predictable: token tuples can be crafted to collide.) Freed
blocks keep their digest and wait in an LRU free list: a later request with the same prefix
takes them back (a cache hit) until the pool needs them for new content (eviction from the
LRU end).
"""

import hashlib
from array import array
from collections import OrderedDict

from conveyor.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_content: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks  # (parent, tokens)
        self.cached: dict[bytes, int] = {}  # block digest -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

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
        new_ids = [self._take_free_block() for _ in range(needed)]
        seq.block_table.extend(new_ids)
        return new_ids

    def free(self, seq: Sequence) -> None:
        # the tail goes to the free list first, so a prefix outlives its extensions
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the tail blocks ``seq`` holds beyond its first ``num_tokens`` tokens (those
        only rejected draft tokens used); returns the blocks it keeps."""
        keep = self.blocks_for(num_tokens)
        for block_id in seq.block_table[keep:]:
            # a tail block grown this step: this sequence's alone, never published as a prefix
            assert self.ref_counts[block_id] == 1 and self.block_hash[block_id] is None, block_id
            self.ref_counts[block_id] = 0
            self.free_blocks[block_id] = None
            self.free_blocks.move_to_end(block_id, last=False)  # holds nothing cached: reused first
        del seq.block_table[keep:]
        return len(seq.block_table)

    # ---- prefix cache -------------------------------------------------------------------
    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence with nothing computed: take the cached blocks of its longest cached
        prefix (never its last token, whose logits must be computed). Returns tokens reused."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs score every prompt position: none may be skipped
        full_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_queries += seq.num_tokens
        for index in range(full_blocks):
            block_id = self.cached.get(self._hash_of(seq, index))
            if block_id is None or self.block_content[block_id] != self._content_of(seq, index):
                break
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_registered_blocks = len(seq.block_table)
        reused = len(seq.block_table) * self.block_size
        self.prefix_hits += reused
        return reused

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks ``seq`` has completely computed since last time."""
        if not self.enable_prefix_caching:
            return
        full_blocks = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for index in range(seq.num_registered_blocks, full_blocks):
            block_hash = self._hash_of(seq, index)
            block_id = seq.block_table[index]
            if block_hash not in self.cached and self.block_hash[block_id] is None:
                self.cached[block_hash] = block_id
                self.block_hash[block_id] = block_hash
                self.block_content[block_id] = self._content_of(seq, index)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full_blocks)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def _hash_of(self, seq: Sequence, index: int) -> bytes:
        """Chained sha256 of block ``index`` of ``seq``, memoised on the sequence."""
        while len(seq.block_hashes) <= index:
            parent = seq.block_hashes[-1] if seq.block_hashes else root_digest(seq)
            seq.block_hashes.append(hashlib.sha256(parent + self._token_bytes(seq, len(seq.block_hashes))).digest())
        return seq.block_hashes[index]

    def _content_of(self, seq: Sequence, index: int) -> tuple[bytes, tuple[int, ...]]:
        """What block ``index`` of ``seq`` holds: its parent's digest (the root's for the first) and its tokens."""
        parent = seq.block_hashes[index - 1] if index else root_digest(seq)
        return parent, tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _token_bytes(self, seq: Sequence, index: int) -> bytes:
        return array("q", seq.token_ids[index * self.block_size : (index + 1) * self.block_size]).tobytes()

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)  # least recently freed
        assert self.ref_counts[block_id] == 0
        if self.block_hash[block_id] is not None:  # evict its cached content
            del self.cached[self.block_hash[block_id]]
            self.block_hash[block_id] = None
            self.block_content[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


def root_digest(seq: Sequence) -> bytes:
    """The first block's parent: the adapter and the cache salt, so prefixes are shared only
    under the same weights and salt."""
    adapter = "" if seq.lora_request is None else str(seq.lora_request.lora_int_id)
    salt = seq.cache_salt or ""
    return hashlib.sha256(f"conveyor-prefix-v2\0{adapter}\0{len(salt)}\0{salt}".encode()).digest()
