"""Blocks of a DOCX: paragraphs, headings (by their Heading N / Title style) and tables (a
row per line, cells joined by ' | '), in body order (python-docx). The zip is checked
before anything is inflated: member count, declared sizes and compression ratios."""

from __future__ import annotations

import io
import re
import zipfile

from conveyor.apps.documents.doc_formats import ExtractError
from conveyor.apps.documents.doc_layout import Block

MAX_MEMBERS = 2000
MAX_UNCOMPRESSED = 256 << 20  # all members together, as declared in the zip
MAX_RATIO = 200  # per member over 1 MiB: text XML compresses ~10x; bombs 1000x
RATIO_FLOOR = 1 << 20
HEADING_STYLE = re.compile(r"^Heading (\d)$")


def check_zip(data: bytes) -> None:
    try:
        members = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ExtractError(f"is a damaged zip archive ({exc})") from None
    if len(members) > MAX_MEMBERS:
        raise ExtractError(f"is a zip of {len(members)} members, over the limit of {MAX_MEMBERS}")
    total = sum(m.file_size for m in members)
    if total > MAX_UNCOMPRESSED:
        raise ExtractError(f"would inflate to {total} bytes, over the limit of {MAX_UNCOMPRESSED} bytes")
    for member in members:
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > RATIO_FLOOR and ratio > MAX_RATIO:
            raise ExtractError(
                f"holds {member.filename!r} compressed {ratio:.0f}:1, over the limit of {MAX_RATIO}:1 (a zip bomb?)"
            )


def docx_blocks(data: bytes) -> list[Block]:
    check_zip(data)
    import docx
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as exc:  # python-docx raises many kinds on a damaged package
        raise ExtractError(f"is a DOCX that cannot be read ({type(exc).__name__}: {exc})") from None
    blocks = []
    for item in document.iter_inner_content():
        if isinstance(item, Table):
            blocks.append(Block(_table_text(item)))
        else:
            blocks.append(Block(item.text, level=_heading_level(item)))
    return blocks


def _heading_level(paragraph) -> int:
    name = paragraph.style.name if paragraph.style is not None else ""
    if name == "Title":
        return 1
    match = HEADING_STYLE.match(name)
    return int(match.group(1)) if match else 0


def _table_text(table) -> str:
    rows = []
    for row in table.rows:
        cells = []
        for cell in row.cells:
            if not cells or cell.text != cells[-1]:  # a merged cell repeats itself
                cells.append(cell.text.strip())
        rows.append(" | ".join(cells))
    return "\n".join(rows)
