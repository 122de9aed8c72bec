"""Where text came from: blocks (paragraphs and headings, with their page) assembled into one
text, and the coordinates of any character range of it (pages, heading path, lines)."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable

MAX_LABEL_HEADING_CHARS = 60  # a citation names the heading, shortened past this


@dataclass(frozen=True)
class Block:
    """One paragraph or heading of an extracted document. `level` > 0 makes it a heading."""

    text: str
    page: int | None = None  # 1-based, where the format has pages (PDF)
    level: int = 0


@dataclass(frozen=True)
class Span:
    """Characters [start, end) of the assembled text: one block, its page and heading path."""

    start: int
    end: int
    page: int | None
    headings: tuple[str, ...]
    heading: bool = False  # the block is itself a heading (chunks prefer to start there)


def assemble(blocks: Iterable[Block]) -> tuple[str, tuple[Span, ...]]:
    """The text (blocks joined by blank lines) and one Span per non-empty block."""
    parts: list[str] = []
    spans: list[Span] = []
    path: list[tuple[int, str]] = []  # (level, heading) from the outermost in
    offset = 0
    for block in blocks:
        text = block.text.strip()
        if not text:
            continue
        if block.level:
            while path and path[-1][0] >= block.level:
                path.pop()
            path.append((block.level, " ".join(text.split())))
        if parts:
            offset += 2  # the "\n\n" before this block
        spans.append(Span(offset, offset + len(text), block.page, tuple(h for _, h in path), bool(block.level)))
        parts.append(text)
        offset += len(text)
    return "\n\n".join(parts), tuple(spans)


def section_starts(text: str, spans: tuple[Span, ...]) -> list[int]:
    """Positions where a chunk had best begin: each heading, each new page."""
    starts, page = [], None
    for span in spans:
        if span.heading or (span.page is not None and span.page != page and page is not None):
            starts.append(span.start)
        page = span.page
    return starts


def coordinates(text: str, spans: tuple[Span, ...], start: int, end: int) -> dict:
    """Pages, heading path and lines of the characters [start, end) of `text`."""
    return Locator(text, spans).coordinates(start, end)


class Locator:
    """Coordinates of the successive chunks of one text, in time linear in the text overall
    (a hostile document may hold millions of paragraphs and thousands of chunks): span ends
    are listed once, and lines are counted forward from the previous chunk's start and end."""

    def __init__(self, text: str, spans: tuple[Span, ...]) -> None:
        self.text, self.spans = text, spans
        self.ends = [s.end for s in spans]
        self.lines_at = {"start": (0, 1), "end": (0, 1)}  # (position, its line) last counted

    def coordinates(self, start: int, end: int) -> dict:
        inside = self._overlapping(start, end)
        pages = sorted({s.page for s in inside if s.page is not None})
        first = inside[0] if inside else None
        return {
            "start": start,
            "end": end,
            "pages": [pages[0], pages[-1]] if pages else None,
            "headings": list(first.headings) if first else [],
            "lines": [self._line("start", start), self._line("end", max(start, end - 1))],
        }

    def _line(self, cursor: str, position: int) -> int:
        """The line of `position`, counted from where this cursor last was (from 0 if past it)."""
        counted, line = self.lines_at[cursor]
        if position < counted:
            counted, line = 0, 1
        line += self.text.count("\n", counted, position)
        self.lines_at[cursor] = (position, line)
        return line

    def _overlapping(self, start: int, end: int) -> list[Span]:
        found = []
        for index in range(bisect_right(self.ends, start), len(self.spans)):  # no slice: no copy
            span = self.spans[index]
            if span.start >= end:
                break
            if span.end > start:
                found.append(span)
        return found


def citation_label(coords: dict) -> str:
    """`p. 3-4` where there are pages, else `§ 2.1 Results`, else `lines 10-42`."""
    if coords.get("pages"):
        first, last = coords["pages"]
        return f"p. {first}" if first == last else f"p. {first}-{last}"
    if coords.get("headings"):
        heading = coords["headings"][-1]
        if len(heading) > MAX_LABEL_HEADING_CHARS:
            heading = heading[: MAX_LABEL_HEADING_CHARS - 1].rstrip() + "…"
        return f"§ {heading}"
    first, last = coords["lines"]
    return f"line {first}" if first == last else f"lines {first}-{last}"


def citation_of(chunks: list[dict]) -> str:
    """One citation for several chunks (their coordinates): page ranges merged (`p. 2-5, 9`),
    else their labels in order, each once."""
    pages = [c["pages"] for c in chunks if c.get("pages")]
    if len(pages) == len(chunks) and pages:
        ranges: list[list[int]] = []
        for first, last in sorted(pages):
            if ranges and first <= ranges[-1][1] + 1:
                ranges[-1][1] = max(ranges[-1][1], last)
            else:
                ranges.append([first, last])
        parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
        return "p. " + ", ".join(parts)
    labels: list[str] = []
    for chunk in chunks:
        label = citation_label(chunk)
        if label not in labels:
            labels.append(label)
    return "; ".join(labels)
