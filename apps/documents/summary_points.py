"""From model output to cited points: cut an unfinished last sentence, drop repeated
sentences, and trace each point of the final summary to the chunk summaries it came from.

Small models quote their input rather than cite it, so the citation is not left to the
model: each final point is matched, by the content words it shares, with the per-chunk
summaries (the leaves of the reduce tree), and cites the coordinates of the best ones."""

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
CLOSE_SECOND = 0.75  # a second source is cited when it matches at least this share of the best


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


def sources_of(point: str, leaves: list[str]) -> list[int]:
    """Indices of the leaf summaries `point` came from: the best match by shared content
    words, and a close second; all leaves when it shares no word with any."""
    words = content_words(point)
    scores = [len(words & content_words(leaf)) / (len(words) or 1) for leaf in leaves]
    best = max(scores, default=0.0)
    if best == 0.0:
        return list(range(len(leaves)))
    ranked = sorted(range(len(leaves)), key=lambda i: -scores[i])
    return sorted(i for i in ranked[:2] if scores[i] >= CLOSE_SECOND * best)


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0
