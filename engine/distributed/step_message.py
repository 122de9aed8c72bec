"""A step plan as the follower ranks need it, in msgpack: the plan's deltas (new sequences'
tokens, scheduled ids with their counts and new blocks, preempted / finished / trimmed
ids) and the tokens rank 0 sampled in the step before (``tails``). Sampling parameters and
grammars stay on rank 0: only it computes logits and samples."""

import msgpack

from conveyor.engine.plan import NewSeqData, ScheduledSeq, StepPlan
from conveyor.engine.sampling_params import SamplingParams

# (seq id, first position replaced, tokens from there): rank 0's token ids after a step
Tail = tuple[str, int, list[int]]


def encode_step(plan: StepPlan, tails: list[Tail]) -> bytes:
    return msgpack.packb(
        [
            plan.step_id,
            [(new.seq_id, new.token_ids) for new in plan.new_seqs],
            [(s.seq_id, s.num_computed, s.num_new, s.new_block_ids, s.draft_token_ids) for s in plan.scheduled],
            plan.preempted_ids,
            plan.finished_ids,
            plan.trimmed_tables,
            tails,
        ]
    )


def decode_step(message: bytes) -> tuple[StepPlan, list[Tail]]:
    step_id, new, scheduled, preempted, finished, trimmed, tails = msgpack.unpackb(message, strict_map_key=False)
    plan = StepPlan(
        step_id,
        [NewSeqData(seq_id, tokens, FOLLOWER_PARAMS) for seq_id, tokens in new],
        [ScheduledSeq(*item) for item in scheduled],
        preempted,
        finished,
        trimmed,
    )
    return plan, [tuple(tail) for tail in tails]


def sampled_tails(plan: StepPlan, sampled_ids, seqs: dict) -> list[Tail]:
    """Every sampled sequence's tokens from its first draft (or its new token) on: what
    sampling appended, and verification kept of its drafts. A sequence the runner forgot
    meanwhile (aborted while its pipelined step was in flight) has none: the ranks forget it too."""
    sampled = set(sampled_ids)
    tails = []
    for item in plan.scheduled:
        if item.seq_id in sampled and item.seq_id in seqs:
            start = item.num_computed + item.num_new - len(item.draft_token_ids)
            tails.append((item.seq_id, start, seqs[item.seq_id].token_ids[start:]))
    return tails


FOLLOWER_PARAMS = SamplingParams()  # followers never sample nor score prompts: defaults stand in
