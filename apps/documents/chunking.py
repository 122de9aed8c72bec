"""Split a text into chunks of at most a token budget, cutting at the best boundary in reach:
a section start (a heading, a new page: given by the caller), else a paragraph break, a
sentence end, a line end, a space, and at worst between tokens.

Token counts come from one encoding of the whole text (token start offsets); the caller's
`excess` check then measures each chunk exactly (inside its full prompt) and the chunk is
cut again, shorter, until it fits.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable

TOKEN, WORD, LINE, SENTENCE, PARAGRAPH, SECTION, END = range(7)  # boundary strength
BOUNDARY_PATTERNS = (
    (WORD, re.compile(r"\s+")),
    (LINE, re.compile(r"\n\s*")),
    (SENTENCE, re.compile(r"[.!?;:][\"'\)\]]*\s+")),
    (PARAGRAPH, re.compile(r"\n[ \t]*\n\s*")),
)
MIN_FILL = 0.5  # a chunk ends at the strongest boundary past half its budget
MIN_SECTION_FILL = 0.25  # or at a section start past a quarter of it


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # character offsets of the chunk in the text (before stripping)
    end: int
    text: str


class Boundaries:
    """Token start offsets and candidate cut positions (with their strength) of one text."""

    def __init__(self, text: str, token_offsets: list[tuple[int, int]], sections: Iterable[int] = ()) -> None:
        self.length = len(text)
        self.token_starts = sorted({start for start, _ in token_offsets})
        strength = dict.fromkeys(self.token_starts, TOKEN)
        for kind, pattern in BOUNDARY_PATTERNS:
            for match in pattern.finditer(text):
                strength[match.end()] = max(kind, strength.get(match.end(), TOKEN))
        for position in sections:
            if 0 < position < self.length:
                strength[position] = SECTION
        strength[self.length] = END
        self.positions = sorted(strength)
        self.strength = [strength[p] for p in self.positions]

    def position_after_tokens(self, start: int, tokens: int) -> int:
        """The furthest position p such that [start, p) starts at most `tokens` tokens."""
        index = bisect_left(self.token_starts, start) + tokens
        return self.token_starts[index] if index < len(self.token_starts) else self.length

    def best_cut(self, start: int, after: int, budget: int) -> int | None:
        """Where a chunk from `start` ends: past `after`, within `budget` tokens; None if nowhere."""
        limit = self.position_after_tokens(start, budget)
        if limit >= self.length:
            return self.length
        fill = self.position_after_tokens(start, int(budget * MIN_FILL))
        section_fill = self.position_after_tokens(start, int(budget * MIN_SECTION_FILL))
        first, last = bisect_right(self.positions, after), bisect_right(self.positions, limit)
        if first >= last:
            return None
        candidates = range(first, last)
        filled = [
            i
            for i in candidates
            if self.positions[i] >= fill or (self.strength[i] >= SECTION and self.positions[i] >= section_fill)
        ] or list(candidates)
        best = max(filled, key=lambda i: (self.strength[i], self.positions[i]))
        return self.positions[best]

    def overlap_start(self, start: int, end: int, tokens: int) -> int:
        """Where the next chunk starts so as to repeat the last `tokens` tokens before `end`,
        moved forward to the strongest boundary within the first half of that overlap."""
        last = bisect_left(self.token_starts, end)
        first = max(last - tokens, bisect_left(self.token_starts, start) + 1)  # always move forward
        if first >= last:
            return end
        half = self.token_starts[(first + last) // 2]
        window = range(bisect_left(self.positions, self.token_starts[first]), bisect_left(self.positions, half) + 1)
        best = max(window, key=lambda i: (self.strength[i], -self.positions[i]))
        return self.positions[best]


def split_text(
    text: str,
    token_offsets: list[tuple[int, int]],
    budget: int,
    overlap: int = 0,
    excess: Callable[[str], int] | None = None,
    sections: Iterable[int] = (),
) -> list[Chunk]:
    """Chunks covering `text`, each of at most `budget` tokens and `excess(chunk) <= 0`,
    preferring to end where a section starts (`sections`: character positions).

    `overlap` tokens (at most half the budget) of each chunk's end are repeated at the
    start of the next. `excess` returns how many tokens a chunk text is over its limit.
    """
    if budget < 1:
        raise ValueError(f"the token budget of a chunk must be at least 1, got {budget}")
    overlap = max(0, min(overlap, budget // 2))
    excess = excess or (lambda _: 0)
    boundaries, chunks = Boundaries(text, token_offsets, sections), []
    start = done = 0  # the next chunk starts at `start` and must cover text past `done`
    while done < len(text):
        chunk = _fitting_chunk(text, boundaries, start, done, budget, excess)
        chunk = chunk or _fitting_chunk(text, boundaries, done, done, budget, excess)  # without overlap
        if chunk is None:
            raise ValueError(f"no text at character {done} fits the token budget of {budget}")
        if chunk.text:
            chunks.append(Chunk(len(chunks), chunk.start, chunk.end, chunk.text))
        done = chunk.end
        start = boundaries.overlap_start(chunk.start, done, overlap) if overlap else done
    return chunks


def _fitting_chunk(
    text: str, boundaries: Boundaries, start: int, done: int, budget: int, excess: Callable[[str], int]
) -> Chunk | None:
    while budget >= 1:
        end = boundaries.best_cut(start, done, budget)
        if end is None:
            return None
        chunk = Chunk(-1, start, end, text[start:end].strip())
        over = excess(chunk.text) if chunk.text else 0
        if over <= 0:
            return chunk
        budget -= over  # the estimate was short by at least this much
    return None
