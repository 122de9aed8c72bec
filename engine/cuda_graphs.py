"""CUDA graphs for decode-only steps (vLLM's cudagraph capture, for the Triton backend).

A decode step's forward launches a few kernels per layer, each for a few microseconds of
work at small batches; replaying a captured graph launches them all at once. Graphs need
fixed shapes and addresses, so:

- the step's inputs are copied into static buffers sized for the largest bucket
  (``DecodeBuffers``), its batch padded up to the smallest captured bucket that holds it:
  padded rows read token 0 at position 0, write to slot -1 (which the Triton cache write
  skips) and attend to nothing (context length 0, which the decode kernel answers with
  zeros), so they change no real row and no cache entry;
- one graph per bucket is captured at start-up (``capture``, the only GPU-only part) and
  replayed per step; a batch beyond the largest bucket, or with a block table wider than
  the buffers, runs eagerly.

``replay`` without a captured graph runs the same forward on the same static buffers
eagerly, which is how a CPU test drives everything but the capture.
"""

from dataclasses import dataclass

import torch

from conveyor.engine.attention_metadata import AttentionMetadata


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (vLLM's steps),
    and ``max_num_seqs`` itself."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 8)
    return sorted(set(sizes) | {max_num_seqs})


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``batch`` rows (None: larger than every bucket)."""
    return next((size for size in buckets if size >= batch), None)


@dataclass
class DecodeBuffers:
    """Static inputs of the captured graphs, for the largest bucket."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        column = lambda: torch.zeros(rows, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            column(), column(), column(), torch.zeros(rows, max_blocks, dtype=torch.long, device=device), column()
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Copy a step's ``n`` rows in, and pad rows ``n:bucket`` (device copies: no host sync)."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        # padding: token 0 at position 0, no slot, no context (stale table rows are never read)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].zero_()

    def meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            self.slot_mapping[:bucket], bucket, self.block_tables[:bucket], self.context_lens[:bucket]
        )


class DecodeGraphs:
    """One graph per bucket over ``forward(input_ids, positions, meta) -> hidden``."""

    def __init__(self, forward, buckets: list[int], max_blocks: int, device: torch.device):
        self.forward, self.buckets, self.max_blocks = forward, buckets, max_blocks
        self.buffers = DecodeBuffers.allocate(buckets[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's static output
        self.replays = self.eager_fallbacks = 0

    def serves(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        return (
            meta.num_decode_tokens == num_tokens
            and num_tokens <= self.buckets[-1]
            and meta.decode_block_tables.shape[1] <= self.max_blocks
        )

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only step the graphs serve (``serves``): rows ``[:n]``."""
        n = input_ids.shape[0]
        bucket = bucket_for(n, self.buckets)
        self.buffers.load(input_ids, positions, meta, bucket)
        self.replays += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        buffers = self.buffers
        return self.forward(buffers.input_ids[:bucket], buffers.positions[:bucket], buffers.meta(bucket))[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool (CUDA only)."""
        pool = torch.cuda.graph_pool_handle()
        buffers = self.buffers
        for bucket in reversed(self.buckets):
            args = (buffers.input_ids[:bucket], buffers.positions[:bucket], buffers.meta(bucket))
            buffers.slot_mapping[:bucket].fill_(-1)  # capture writes nothing into the cache
            self.forward(*args)  # warm-up: Triton compiles, allocator settles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.forward(*args)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
