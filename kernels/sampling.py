"""Batched sampling helpers: every function works on a whole step's logits ``[B, V]``
with per-row parameters ``[B]``, so a step costs one call, not a Python loop per row."""

import torch


def apply_penalties(
    logits: torch.Tensor,
    seen_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM/OpenAI semantics. ``seen_mask`` ``[B, V]``: token in prompt or output (repetition
    penalty); ``output_counts`` ``[B, V]``: occurrences in the output (presence, frequency)."""
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_mask, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask filtered-out tokens with -inf. ``top_k`` 0 = off; ``top_p`` 1 = off; ``min_p`` 0 = off."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the top token always survives)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def sample_with_noise(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: argmax(p / E) with E ~ Exp(1) is an exact sample from ``p``
    (the exponential race), and lets each row bring noise from its own generator."""
    return greedy_tokens(probs / exp_noise)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first of equal maxima, as ``argmax`` picks. ``max(dim)`` finds
    the same index 2.4x faster on CPU (64 x 49,152 float32 logits: 0.95 ms against 2.3 ms on
    2 AVX-512 cores; the argmax was 4% of a 64-sequence decode step: docs/performance.md)."""
    return scores.max(dim=-1).indices
