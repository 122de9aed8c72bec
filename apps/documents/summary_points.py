"""From model output to sentences: cut an unfinished last sentence, drop repeated sentences.

Small models quote their input rather than cite it, so the citation is not left to the
model: grounding.py matches each final point, by the content words it shares, with the
chunks' text and cites only the chunks it is grounded in."""

from __future__ import annotations

import re

SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
FINISHED = re.compile(r"[.!?][\"')\]]*$")
WORD = re.compile(r"[^\W_]{3,}")
STOP_WORDS = frozenset(
    "the and for are but not you all any can had her was one our out has have this that with "
    "from they will would there their what which when where who been into than then them "
    "these those its also such may each other more most some only about over under text "
    "document summary summaries part parts".split()
)
SAME_POINT = 0.6  # word-set overlap (Jaccard) at which two sentences say the same thing


def finished(text: str) -> str:
    """`text` without a trailing unfinished sentence (kept whole when it has no sentence end)."""
    text = text.strip()
    if FINISHED.search(text):
        return text
    ends = [m.start() for m in SENTENCE_END.finditer(text)]
    return text[: ends[-1]].strip() if ends else text


def sentences(text: str) -> list[str]:
    lines = (line.strip().lstrip("-*•0123456789.) ").strip() for line in text.splitlines())
    return [s.strip() for line in lines if line for s in SENTENCE_END.split(line) if s.strip()]


def content_words(text: str) -> frozenset[str]:
    return frozenset(w for w in (m.group(0).lower() for m in WORD.finditer(text)) if w not in STOP_WORDS)


def without_repeats(points: list[str]) -> list[str]:
    """Points in order, each dropped when it says what an earlier one said."""
    kept: list[tuple[str, frozenset[str]]] = []
    for point in points:
        words = content_words(point)
        if not any(_jaccard(words, seen) >= SAME_POINT or point == text for text, seen in kept):
            kept.append((point, words))
    return [text for text, _ in kept]


def deduplicated(text: str) -> str:
    """A summary with repeated sentences removed (the looping of a small model)."""
    return " ".join(without_repeats(sentences(text)))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0
