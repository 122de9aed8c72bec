"""Logprobs of the prompt's own tokens (``SamplingParams.prompt_logprobs``).

The hidden state at prompt position p scores token p + 1, so a step that computes
positions [start, end) of a prompt of P tokens scores tokens start + 1 .. min(end, P - 1)
(position P - 1 scores the first output token: that is the sampler's). The scheduler never
serves such a prompt from the prefix cache (block_manager.reuse_cached_prefix): every
position must be computed to be scored. Logits are made in slices of rows, so a long
prefill chunk never holds a [chunk, vocab] tensor at once.
"""

from dataclasses import dataclass

import torch

from conveyor.engine.plan import ScheduledSeq, TokenLogprobs
from conveyor.engine.sampler import token_logprobs, token_ranks

SLICE_ROWS = 256


@dataclass
class PromptSpan:
    seq_id: str
    offset: int  # row of its first position in the step's hidden states
    start: int  # its first position
    count: int  # positions from ``start`` on that score a prompt token


def prompt_span(item: ScheduledSeq, offset: int, num_prompt_tokens: int) -> PromptSpan | None:
    count = min(item.num_computed + item.num_new, num_prompt_tokens - 1) - item.num_computed
    return PromptSpan(item.seq_id, offset, item.num_computed, count) if count > 0 else None


def score_prompt(
    hidden: torch.Tensor, compute_logits, span: PromptSpan, token_ids: list[int], num_top: int
) -> list[TokenLogprobs]:
    """TokenLogprobs of prompt tokens span.start + 1 .. span.start + span.count."""
    scored = []
    for first in range(0, span.count, SLICE_ROWS):
        rows = hidden[span.offset + first : span.offset + min(span.count, first + SLICE_ROWS)]
        logprobs = compute_logits(rows).float().log_softmax(dim=-1)
        begin = span.start + first + 1
        targets = torch.tensor(token_ids[begin : begin + rows.shape[0]], dtype=torch.long, device=rows.device)
        ranks = token_ranks(logprobs, targets).tolist()
        scored += [
            token_logprobs(row, target, num_top, rank) for row, target, rank in zip(logprobs, targets.tolist(), ranks)
        ]
    return scored
