"""Keeping a summary to what its document says: the grounding rule, filler detection and the
extractive fallback. Deterministic, no model.

Grounding rule. Words are lowercase letter runs of 3+ characters, less a stop-word list, with
a crude suffix strip (`-ing`, `-ed`, `-es`, `-s`, then a final `e`: "batched", "batches" and
"batching" are one word). A sentence is *grounded in* a chunk when it shares with the chunk's
text at least MIN_SHARED_WORDS (2) content words, or 1 when it has only 1 or 2 (at least
half of them: "Queues keep jobs." has two). A sentence with no content word is never
grounded. A point cites only chunks it is grounded in: the one sharing the most words with it
and any other sharing at least CLOSE_SECOND (75%) as many, at most MAX_CITED (2); a point
grounded in no chunk is dropped, never cited to every chunk.

Filler: FILLER_PATTERNS, assistant boilerplate ("I'm here to help", "I'm ready to assist",
"please provide the document", "as an AI", "Sure! Here is", requests for the text). A filler
sentence is never a point and never part of a chunk summary.

Extractive fallback: a chunk the model summarized with nothing usable (twice) is summarized
by its EXTRACTIVE_SENTENCES (2) most salient sentences: those whose distinct content words
have the highest mean frequency in the whole document, among sentences of at least
MIN_SALIENT_WORDS (3) content words when there are any; kept in the chunk's order.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from conveyor.apps.documents.summary_points import SENTENCE_END, STOP_WORDS

WORD = re.compile(r"[^\W\d_]{3,}")
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# Function words and the vocabulary of talking about a text or to a user, on top of the
# point-deduplication list: sharing "following" or "provide" with a chunk supports nothing.
GROUNDING_STOP_WORDS = STOP_WORDS | frozenset(
    "very much many well being both same own why how does did doing here just like make made uses "
    "use used using via per within without between while because should could must shall might "
    "him his she hers your yours ours mine its itself we me my i am is be being get got "
    "following provided provide given give please help assist ready sure certainly happy glad "
    "information content passage article describes described discusses discussed explains "
    "explained mentions mentioned states stated talks about overall".split()
)
SUFFIXES = ("ing", "ed", "es", "s")
MIN_SHARED_WORDS = 2
CLOSE_SECOND = 0.75  # exact in binary: counts compare without rounding
MAX_CITED = 2
EXTRACTIVE_SENTENCES = 2
MIN_SALIENT_WORDS = 3

FILLER_PATTERNS = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"\b(i'?m|i am|i'?d be|i would be)\s+(here|ready|happy|glad|delighted|able)\s+to\s+(help|assist)",
        r"\b(here|ready|happy|glad)\s+to\s+(help|assist)\b",
        r"\bhow (can|may|could) i (help|assist)",
        r"\bas an? (ai|language model|assistant)\b",
        r"\bplease (provide|share|send|paste|give|upload|specify)\b",
        r"\b(provide|share|paste|send|upload) (me )?(the|your|a|some) (text|document|passage|article|content|file)",
        r"\b(with|on) your (document|text|request|summary)\b",
        r"^(sure|certainly|of course|absolutely|okay|ok)\b[!,.]?",
        r"^here('s| is| are)\b",
        r"\blet me know\b",
        r"\bfeel free to\b",
        r"\bi (can|could|will|would|'ll) (help|assist|summarize|provide)\b",
        r"\bi (do not|don't|cannot|can't|am unable to) (have|see|access|read|find)\b",
        r"\byou (have )?(provided|shared|given)\b",
        r"\bwhat (would you like|do you want)\b",
    )
)


def stem(word: str) -> str:
    """`word` less one common suffix and a final `e` (a crude, stated normalization)."""
    if not word.endswith("ss"):
        for suffix in SUFFIXES:
            if word.endswith(suffix) and len(word) - len(suffix) >= 3:
                word = word[: -len(suffix)]
                break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def content_words(text: str) -> frozenset[str]:
    """The stemmed content words of `text` (see the module docstring)."""
    words = (m.group(0).lower() for m in WORD.finditer(text))
    return frozenset(stem(w) for w in words if w not in GROUNDING_STOP_WORDS)


def is_filler(sentence: str) -> bool:
    """Assistant boilerplate rather than a statement about the document."""
    text = sentence.strip().replace("\u2019", "'")
    return any(pattern.search(text) for pattern in FILLER_PATTERNS)


def grounded(words: frozenset[str], source: frozenset[str]) -> bool:
    """The grounding rule: enough of a sentence's content words appear in the source."""
    if not words:
        return False
    needed = 1 if len(words) <= MIN_SHARED_WORDS else MIN_SHARED_WORDS  # a short sentence: half of it
    return len(words & source) >= needed


def cited_chunks(point: str, chunk_words: list[frozenset[str]]) -> list[int]:
    """The chunks `point` is grounded in and cites (best, and a close second); [] when none:
    the point is then unsupported and must be dropped."""
    words = content_words(point)
    shared = [(len(words & c), i) for i, c in enumerate(chunk_words) if grounded(words, c)]
    if not shared:
        return []
    best = max(count for count, _ in shared)
    ranked = sorted(shared, key=lambda c: (-c[0], c[1]))[:MAX_CITED]
    return sorted(i for count, i in ranked if count >= CLOSE_SECOND * best)


@dataclass(frozen=True)
class Screened:
    """A model's text split into what is kept and what was dropped (with why)."""

    kept: list[str]
    dropped: list[tuple[str, str]]  # (sentence, "filler" | "ungrounded")

    @property
    def text(self) -> str:
        return " ".join(self.kept)


def screen(sentences_: list[str], source: frozenset[str]) -> Screened:
    """Keep the sentences that are not filler and are grounded in `source` (content words)."""
    kept, dropped = [], []
    for sentence in sentences_:
        if is_filler(sentence):
            dropped.append((sentence, "filler"))
        elif not grounded(content_words(sentence), source):
            dropped.append((sentence, "ungrounded"))
        else:
            kept.append(sentence)
    return Screened(kept, dropped)


def word_frequencies(text: str) -> Counter[str]:
    """How often each content word occurs in `text` (the document)."""
    words = (m.group(0).lower() for m in WORD.finditer(text))
    return Counter(stem(w) for w in words if w not in GROUNDING_STOP_WORDS)


def salient_sentences(chunk: str, frequencies: Counter[str], count: int = EXTRACTIVE_SENTENCES) -> list[str]:
    """The `count` sentences of `chunk` whose distinct content words are most frequent in the
    document on average (ties: the earlier), in the chunk's order. Sentences of fewer than
    MIN_SALIENT_WORDS content words (headings, fragments) only when there is nothing else."""
    paragraphs = (" ".join(p.split()) for p in PARAGRAPH_BREAK.split(chunk))  # wrapped lines rejoined
    candidates = [s.strip() for p in paragraphs for s in SENTENCE_END.split(p) if s.strip()]
    scored = [(s, content_words(s)) for s in candidates]
    full = [(s, w) for s, w in scored if len(w) >= MIN_SALIENT_WORDS] or [(s, w) for s, w in scored if w]
    ranked = sorted(range(len(full)), key=lambda i: (-sum(frequencies[w] for w in full[i][1]) / len(full[i][1]), i))[
        :count
    ]
    return [full[i][0] for i in sorted(ranked)]
