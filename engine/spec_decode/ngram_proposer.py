"""Prompt lookup: draft tokens copied from earlier in the sequence itself.

The longest suffix n-gram (``min_n <= n <= max_n``) that also occurs earlier in the
sequence (prompt and output alike) is found; the drafts are the up-to-k tokens that
followed its most recent earlier occurrence. An occurrence may overlap the suffix (a
sequence that repeats one token drafts more of it). vLLM's NgramProposer takes the same
longest match but its earliest occurrence; on SmolLM2 summaries of licence texts the most
recent one had 9.6% more drafts accepted (536 vs 489 tokens over 9 jobs, docs/speculative.md).

The search is vectorised over the whole sequence for its last token, then narrowed on the
few candidate positions only, one token further back at a time: O(length) numpy work and
O(max_n) Python steps per call, with no per-sequence index to keep.
"""

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (1-D ints); [] without a match."""
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        # ends[i]: the index of the last token of an earlier occurrence of the suffix n-gram
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        n = 1
        while n < self.max_n and ends.size:
            longer = ends[ends >= n]
            longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if n < self.min_n or not ends.size:
            return []
        start = int(ends[-1]) + 1  # the most recent occurrence
        return tokens[start : start + k].tolist()
