"""The runner's half of speculative decoding: verifying draft tokens.

A sequence with k drafts runs k + 1 positions in one step (its last token, then the
drafts), each as a decode query over the cache up to itself. The sampler picks a target
token at every position, exactly as a step of its own would have there: temperature,
top-k/p, min-p, penalties over the tokens before that position, the min_tokens mask.
The drafts that agree with the targets are kept, up to the first that does not, plus the
target after them: the correction where a draft was rejected, the bonus token where all
were accepted. So a step emits 1 to k + 1 tokens.

This is rejection sampling for a point-mass draft q = delta(d): "accept d with probability
p(d), else sample from p with d removed, renormalised" is what drawing x ~ p and accepting
d iff x == d does (P(accept) = p(d), and a rejected x is distributed as p restricted to
x != d). Every emitted token is drawn from the target distribution; greedy is the
argmax case, so greedy output is token-identical with speculation off.

Per-request seeds: a seeded row draws one noise row per verified position; afterwards its
generator is rewound to have drawn exactly one per emitted token, so its stream is consumed
as without speculation: token i always uses draw i, whatever the drafts or the batch.
"""

from conveyor.engine.plan import StepResult
from conveyor.engine.sampler import Sampler, SamplingRow


class PositionRow:
    """A SamplingRow as it is at one verified position: its first ``length`` tokens (all
    else is the row's own)."""

    __slots__ = ("row", "length")

    def __init__(self, row: SamplingRow, length: int):
        self.row, self.length = row, length

    def __getattr__(self, name: str):
        return getattr(self.row, name)

    token_ids = property(lambda self: self.row.token_ids[: self.length])
    num_output_tokens = property(lambda self: self.length - self.row.num_prompt_tokens)


def verify(
    sampler: Sampler,
    logits,
    seq_ids: list[str],
    rows: list[SamplingRow],
    drafts: dict[str, list[int]],
    grammar_masks=None,
) -> StepResult:
    """``logits``: per row, one row per verified position (1 + its drafts); each row's
    ``token_ids`` end with its drafts. Leaves every row with its kept tokens. Rows with a
    grammar (never drafted, see speculates()) are masked and advanced by ``grammar_masks``
    as in a step without drafts; one that cannot go on is in the result's ``errors``."""
    positions, counts = [], []
    for seq_id, row in zip(seq_ids, rows):
        draft = drafts.get(seq_id, ())
        assert not draft or row.params.logprobs is None, "speculates() keeps logprobs rows out"
        assert not draft or getattr(row, "grammar", None) is None, "speculates() keeps structured rows out"
        base = len(row.token_ids) - len(draft)
        positions += [PositionRow(row, base + j) for j in range(len(draft) + 1)] if draft else [row]
        counts.append(len(draft))
    rewinds = [_rewind_state(row, count) for row, count in zip(rows, counts)]
    masked = grammar_masks.apply(logits, positions) if grammar_masks is not None else []
    targets, logprobs = sampler(logits, positions)
    failed_positions = grammar_masks.accept(positions, targets, masked) if masked else {}
    result = StepResult()
    offset = 0
    for seq_id, row, count, state in zip(seq_ids, rows, counts, rewinds):
        if offset in failed_positions:  # its structured output cannot go on: that request fails alone
            row.token_ids.append(targets[offset])  # a step already planned counts on a token
            result.errors[seq_id] = failed_positions[offset]
            offset += 1
            continue
        draft, picked = row.token_ids[len(row.token_ids) - count :], targets[offset : offset + count + 1]
        accepted = _num_agreeing(draft, picked)
        del row.token_ids[len(row.token_ids) - count + accepted :]  # the rejected drafts
        row.token_ids.append(picked[accepted])
        if state is not None:
            row.generator.set_state(state)
            sampler.advance(row.generator, accepted + 1, logits.shape[-1])
        result.seq_ids.append(seq_id)
        result.token_ids.append(picked[0])
        if accepted:
            result.extra_token_ids[seq_id] = picked[1 : accepted + 1]
        if offset in logprobs:
            result.logprobs[seq_id] = logprobs[offset]
        offset += count + 1
    return result


def _num_agreeing(draft: list[int], targets: list[int]) -> int:
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def _rewind_state(row: SamplingRow, num_drafts: int):
    """The generator state to rewind to: only seeded sampling rows with drafts draw noise that
    matters for more positions than they keep."""
    if num_drafts and row.generator is not None and not row.params.greedy:
        return row.generator.get_state()
    return None
