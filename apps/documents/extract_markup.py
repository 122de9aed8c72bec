"""Blocks of plain text, Markdown and reST: paragraphs split at blank lines, headings kept
with their level (ATX and setext in Markdown; over/underlined titles in reST, levels in
the order their adornment styles first appear, as docutils assigns them).

Linear time on any text (it runs in the summarizer's process): every pattern is matched at
a line start and costs at most that line (and the next, for reST); an ATX heading's
closing `#`s are cut by rstrip, not by a lazy group before a trailing repeat (which made
one long heading line quadratic: 200 KB took over a minute)."""

from __future__ import annotations

import re

from conveyor.apps.documents.doc_formats import RST_ADORNMENT
from conveyor.apps.documents.doc_layout import Block

PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_OPEN = re.compile(r" {0,3}(#{1,6})[ \t]+")  # the title: the rest, less trailing spaces and '#'s
ATX_CLOSING = " \t#"
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


def text_blocks(text: str, kind: str) -> list[Block]:
    if kind == "markdown":
        return markdown_blocks(text)
    if kind == "rst":
        return rst_blocks(text)
    return [Block(p) for p in PARAGRAPH_BREAK.split(text)]


def markdown_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    paragraph: list[str] = []
    fenced = False

    def flush() -> None:
        if paragraph:
            blocks.append(Block("\n".join(paragraph)))
            paragraph.clear()

    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else ATX_OPEN.match(line)
        setext = None if fenced or len(paragraph) != 1 else SETEXT.match(line)
        if heading:
            flush()
            blocks.append(Block(line[heading.end() :].rstrip(ATX_CLOSING), level=len(heading.group(1))))
        elif setext:
            blocks.append(Block(paragraph.pop(), level=1 if setext.group(1)[0] == "=" else 2))
        elif not line.strip() and not fenced:
            flush()
        else:
            paragraph.append(line)
    flush()
    return blocks


def rst_blocks(text: str) -> list[Block]:
    """Titles underlined (optionally also overlined) with a run of one punctuation mark."""
    blocks: list[Block] = []
    styles: list[tuple[str, bool]] = []  # adornment (char, overlined) in order of appearance
    position = 0
    for match in RST_ADORNMENT.finditer(text):
        title, char = match.group(1).strip(), match.group(2)
        if len(match.group(0).split("\n")[1].strip()) < len(title) or set(title) == {char}:
            continue  # an underline shorter than its title, or an overline line: not a title here
        before = text[position : match.start()]
        overlined = before.rstrip("\n").endswith(char * 3)
        if overlined:
            before = before.rstrip("\n").rsplit("\n", 1)[0] if "\n" in before.rstrip("\n") else ""
        blocks.extend(Block(p) for p in PARAGRAPH_BREAK.split(before))
        style = (char, overlined)
        if style not in styles:
            styles.append(style)
        blocks.append(Block(title, level=styles.index(style) + 1))
        position = match.end()
    blocks.extend(Block(p) for p in PARAGRAPH_BREAK.split(text[position:]))
    return blocks
