"""Blocks of a PDF's text layer, page by page (pypdf). No OCR: a PDF whose pages carry no
text is refused, naming its page count."""

from __future__ import annotations

import io
import logging

from conveyor.apps.documents.doc_formats import ExtractError
from conveyor.apps.documents.doc_layout import Block
from conveyor.apps.documents.extract_markup import PARAGRAPH_BREAK

MAX_PAGES = 2000


def pdf_blocks(data: bytes, max_pages: int = MAX_PAGES) -> list[Block]:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # malformed files warn on every object
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ExtractError("is an encrypted PDF (a password is needed to read its text)")
        pages = _page_count(reader, max_pages)
        blocks = [Block(p, page=n) for n, page in enumerate(reader.pages, 1) for p in _paragraphs(page)]
    except PdfReadError as exc:
        raise ExtractError(f"is a PDF that cannot be read ({exc})") from None
    if not blocks:
        raise ExtractError(f"is a PDF without a text layer on any of its {pages} pages (a scan? OCR is not done)")
    return blocks


def _page_count(reader, max_pages: int) -> int:
    declared = reader.trailer["/Root"]["/Pages"].get("/Count", 0)  # before pypdf walks the page tree
    if not isinstance(declared, int) or declared > max_pages:
        raise ExtractError(f"is a PDF of {declared} pages, over the limit of {max_pages} pages")
    pages = len(reader.pages)
    if pages > max_pages:
        raise ExtractError(f"is a PDF of {pages} pages, over the limit of {max_pages} pages")
    return pages


def _paragraphs(page) -> list[str]:
    text = page.extract_text() or ""
    return [p for p in PARAGRAPH_BREAK.split(text) if p.strip()]
