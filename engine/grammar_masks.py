"""Structured outputs where tokens are sampled (the model runner): each constrained sequence
has a matcher (``GrammarState``, kept on the runner's copy of the sequence, also across
preemption: recomputing a prompt samples nothing, so no token is accepted twice), and each
step makes one bitmask pass over the rows that need it (``GrammarMasks``): fill their rows
of one token bitmask, mask their logits with it, sample, then check and accept each
row's token. A row that cannot go on fails its request alone, with the reason.

A matcher ends (``done``) once it accepted a stop token: the engine ends such a sequence
with that token (engine/finishing.py), and a step already planned for it samples a token
that is thrown away, so its row is left unmasked.
"""

import torch
import xgrammar as xgr

DEAD_END = (
    "structured_outputs: no token the grammar allows could be sampled (min_tokens bans the stop "
    "token ids the grammar needs here)"
)
REJECTED = "structured_outputs: the grammar matcher rejected token {token} (allowed by its own bitmask)"


class GrammarState:
    """One sequence's matcher (the runner's: it alone samples for the sequence)."""

    def __init__(self, grammar):
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.done = False  # accepted a stop token, or failed: nothing more to constrain

    def resume(self, token_ids: list[int]) -> None:
        """Accept the outputs an earlier attempt sampled under this grammar (a resumed request).
        The replica checked them as that attempt's; one the matcher refuses ends constraining
        (the output then follows the model alone) rather than the request."""
        for token in token_ids:
            if not self.matcher.accept_token(token):
                self.done = True
                return
        self.done = self.matcher.is_terminated()


class GrammarMasks:
    """The step's bitmask pass, for the rows (RunnerSeq) whose grammar is live."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bitmask: torch.Tensor | None = None  # rows grow to the largest step seen
        self.words = None  # the bitmask as a numpy array
        self.batch = None  # xgrammar's filler (threads: half the cores), made on first use

    def apply(self, logits: torch.Tensor, rows: list) -> list[int]:
        """Mask ``logits`` in place (banned tokens -> -inf); returns the masked row indices."""
        live = [index for index, row in enumerate(rows) if row.grammar is not None and not row.grammar.done]
        if not live:
            return live
        bitmask = self._bitmask(len(rows))
        self.batch = self.batch or xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask([rows[index].grammar.matcher for index in live], bitmask, live)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=live
        )
        return live

    def accept(self, rows: list, token_ids: list[int], live: list[int]) -> dict[int, str]:
        """Advance the masked rows' matchers by their sampled tokens; {row index: why it failed}."""
        failed = {}
        for index in live:
            row, token = rows[index], token_ids[index]
            state = row.grammar
            if not self._allowed(index, token) or _banned_by_min_tokens(row, token):
                failed[index] = DEAD_END  # every allowed token was -inf: nothing valid was left to sample
            elif not state.matcher.accept_token(token):
                failed[index] = REJECTED.format(token=token)
            state.done = index in failed or state.matcher.is_terminated()
        return failed

    def _allowed(self, index: int, token: int) -> bool:
        """Whether ``token`` is set in bitmask row ``index``."""
        return bool((int(self.words[index, token >> 5]) >> (token & 31)) & 1)

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        if self.bitmask is None or self.bitmask.shape[0] < num_rows:
            self.bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
            self.words = self.bitmask.numpy()  # the same memory: single bits read without torch ops
        return self.bitmask


def _banned_by_min_tokens(row, token: int) -> bool:
    """The sampler bans these before min_tokens; picked only when nothing else was left."""
    return row.num_output_tokens < row.params.min_tokens and token in row.min_tokens_stop_ids
