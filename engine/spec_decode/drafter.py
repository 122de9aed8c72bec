"""The scheduler's half of speculative decoding: draft tokens for the sequences a step
decodes, and the counts of drafted and accepted tokens.

A sequence gets drafts only when ``speculates(params)`` and only as many as can be of use:
at most ``num_speculative_tokens``, and never more than it may still emit less one (the
step emits the accepted drafts plus one token), nor past ``max_model_len``. The scheduler
further caps them by what the step leaves of its token budget and free KV slots.
"""

import numpy as np

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence
from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.engine.spec_decode.ngram_proposer import NgramProposer


def speculates(params: SamplingParams) -> bool:
    """Whether a request's decode steps may carry draft tokens. Penalties and min_tokens
    apply at each verified position as in a step of its own (engine/spec_decode/verifier.py);
    not speculated: rows asking logprobs (a step reports one TokenLogprobs per sequence) and
    rows with structured output (its grammar state advances token by token)."""
    return params.logprobs is None and getattr(params, "structured_outputs", None) is None


class TokenHistory:
    """A sequence's token ids as a growing numpy array (sequences only ever grow), so each
    proposal copies only the tokens added since the last one."""

    def __init__(self):
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        assert len(token_ids) >= self.length, "a sequence's tokens only grow"
        if len(token_ids) > len(self.array):
            grown = np.empty(max(len(token_ids), 2 * len(self.array)), dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        self.array[self.length : len(token_ids)] = token_ids[self.length :]
        self.length = len(token_ids)
        return self.array[: self.length]


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.histories: dict[Sequence, TokenHistory] = {}
        self.num_drafts = 0  # sequence-steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def drafts_step(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` sequences gets drafts (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or batch_size <= limit

    def drafts_for(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens to verify after ``seq``'s last token; ``room``: what the step can hold."""
        limit = min(
            self.config.num_speculative_tokens,
            room,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0 or not speculates(seq.params):
            return []
        history = self.histories.setdefault(seq, TokenHistory())
        return self.proposer.propose(history.sync(seq.token_ids), limit)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted

    def forget(self, seq: Sequence) -> None:
        self.histories.pop(seq, None)

    def stats(self) -> dict:
        return spec_stats(self)


def spec_stats(drafter: "Drafter | None") -> dict:
    """Cumulative counts (zeros without speculation), vLLM's metric names."""
    drafts, drafted, accepted = (
        (drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens)
        if drafter is not None
        else (0, 0, 0)
    )
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": drafted,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
        # tokens a drafting step emits per sequence on average: accepted drafts + 1
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def make_drafter(config: SpeculativeConfig | None, max_model_len: int) -> Drafter | None:
    return Drafter(config, max_model_len) if config is not None else None
