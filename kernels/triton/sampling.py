"""Sampling on the device in two launches, returning only the sampled ids (one int per row
crosses to the host). The semantics are kernels/sampling.py's (vLLM's):

1. ``_penalize_kernel`` (rows x vocabulary tiles): repetition, presence and frequency
   penalties on the step's float32 logits, in place;
2. ``_draw_kernel`` (one program per row): greedy rows take the argmax; the others divide
   by their temperature, keep the top-k, then the top-p prefix of those (by their softmax),
   drop tokens under min-p times the top probability, and draw with the exponential race
   ``argmax(p / E)`` on noise the caller brings (each row's own generator).

Top-k and top-p need no sort: each is a threshold on the logits found by bisection, 40
passes over the row (a pass counts tokens, or sums probability mass, above the midpoint),
which pins the threshold between two adjacent float32 values. Tied logits at a top-k
boundary are all kept (the sorting reference keeps the first k).
"""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton import interpreted

BLOCK_V = 4096 if interpreted() else 1024  # vocabulary tile
BISECTION_STEPS = 40


@triton.jit
def _penalize_kernel(logits, seen, counts, repetition, presence, frequency, vocab, stride, BLOCK: tl.constexpr):
    row, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    value = tl.load(logits + row * stride + cols, mask=ok, other=0.0)
    was_seen = tl.load(seen + row * stride + cols, mask=ok, other=0) != 0
    count = tl.load(counts + row * stride + cols, mask=ok, other=0.0)
    rep = tl.load(repetition + row)
    value = tl.where(was_seen, tl.where(value > 0, value / rep, value * rep), value)
    value = value - tl.load(frequency + row) * count - tl.load(presence + row) * (count > 0).to(tl.float32)
    tl.store(logits + row * stride + cols, value, mask=ok)


@triton.jit
def _mass_above(logits, row_base, vocab, threshold, floor, top, scale, BLOCK: tl.constexpr):
    """Sum of exp(l - top) over tokens with floor <= l and l > threshold (l: scaled logits)."""
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        value = tl.load(logits + row_base + cols, mask=cols < vocab, other=float("-inf")) * scale
        total += tl.where((value > threshold) & (value >= floor), tl.exp(value - top), 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _count_at_least(logits, row_base, vocab, threshold, scale, BLOCK: tl.constexpr):
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        value = tl.load(logits + row_base + cols, mask=cols < vocab, other=float("-inf")) * scale
        count += (value >= threshold).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _first_argmax(best, best_id, vocab):
    """Lane-wise running maxima -> the maximum and its first index."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_id, vocab), axis=0)


@triton.jit
def _draw_kernel(
    logits, noise, out, temperature, top_k, top_p, min_p, vocab, stride, BLOCK: tl.constexpr, STEPS: tl.constexpr
):
    row = tl.program_id(0)
    base = row * stride
    temp = tl.load(temperature + row)
    scale = tl.where(temp > 0, 1.0 / tl.where(temp > 0, temp, 1.0), 1.0)
    # greedy (and the row's range): lane-wise running max / min, the first index among ties
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    lowest = tl.full([BLOCK], float("inf"), tl.float32)
    best_lane = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        value = tl.load(logits + base + cols, mask=cols < vocab, other=float("-inf"))
        better = value > best
        best, best_lane = tl.where(better, value, best), tl.where(better, cols, best_lane)
        lowest = tl.minimum(lowest, tl.where(cols < vocab, value, float("inf")))
    best_value, best_id = _first_argmax(best, best_lane, vocab)
    top, floor = best_value * scale, tl.min(lowest, axis=0) * scale  # scaled: top-k keeps l >= floor
    if temp > 0:
        k = tl.load(top_k + row)
        if (k > 0) & (k < vocab):
            lo, hi = floor, top
            for _ in range(STEPS):  # invariant: count(>= lo) >= k > count(>= hi)
                mid = lo + (hi - lo) * 0.5
                enough = _count_at_least(logits, base, vocab, mid, scale, BLOCK) >= k
                lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid)
            floor = lo
        p = tl.load(top_p + row)
        cut = floor - 1.0  # top-p: keep logits > cut
        if p < 1.0:
            kept_mass = _mass_above(logits, base, vocab, floor - 1.0, floor, top, scale, BLOCK)
            lo, hi = floor - 1.0, top
            for _ in range(STEPS):  # invariant: mass above lo >= p * kept, mass above hi < p * kept
                mid = lo + (hi - lo) * 0.5
                heavy = _mass_above(logits, base, vocab, mid, floor, top, scale, BLOCK) >= p * kept_mass
                lo, hi = tl.where(heavy, mid, lo), tl.where(heavy, hi, mid)
            cut = lo
        # min-p: p >= min_p * p_top  <=>  l >= top + log(min_p)
        mp = tl.load(min_p + row)
        min_logit = tl.where(mp > 0, top + tl.log(tl.where(mp > 0, mp, 1.0)), float("-inf"))
        race_best = tl.full([BLOCK], -1.0, tl.float32)
        race_lane = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < vocab
            value = tl.load(logits + base + cols, mask=ok, other=float("-inf")) * scale
            keep = ok & (value >= floor) & (value > cut) & ((value >= min_logit) | (value == top))
            e = tl.load(noise + base + cols, mask=ok, other=1.0)
            race = tl.where(keep, tl.exp(value - top) / e, -1.0)
            better = race > race_best
            race_best, race_lane = tl.where(better, race, race_best), tl.where(better, cols, race_lane)
        _, best_id = _first_argmax(race_best, race_lane, vocab)
    tl.store(out + row, best_id.to(tl.int64))


def apply_penalties_(
    logits: torch.Tensor,
    seen_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """``kernels.sampling.apply_penalties`` on float32 ``logits`` ``[B, V]``, in place."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    seen = seen_mask.to(torch.uint8).contiguous()
    counts = output_counts.float().contiguous()
    _penalize_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        logits, seen, counts, repetition, presence, frequency, vocab, logits.stride(0), BLOCK=BLOCK_V
    )
    return logits


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64, on the device): temperature 0 is greedy. ``logits``
    ``[B, V]`` float32 (penalties already applied); ``exp_noise`` ``[B, V]``: Exp(1) draws;
    per-row ``top_k`` (0 off), ``top_p`` (1 off), ``min_p`` (0 off)."""
    rows, vocab = logits.shape
    assert logits.dtype == exp_noise.dtype == torch.float32 and logits.is_contiguous() and exp_noise.is_contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _draw_kernel[(rows,)](
            logits,
            exp_noise,
            out,
            temperature.float(),
            top_k.to(torch.int32),
            top_p.float(),
            min_p.float(),
            vocab,
            logits.stride(0),
            BLOCK=BLOCK_V,
            STEPS=BISECTION_STEPS,
        )
    return out
