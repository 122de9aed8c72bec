"""What a file is, told by its bytes (magic numbers, then structure), and its text decoded.

Formats: pdf, docx, html, markdown, rst, text. The file's suffix only breaks ties between
the text formats (a README.md without any heading is still Markdown)."""

from __future__ import annotations

import codecs
import io
import re
import zipfile

SNIFF_BYTES = 4096
BINARY_CONTROL_SHARE = 0.01  # more C0 control bytes than this (NUL included): not text
TEXT_CONTROLS = frozenset(b"\t\n\r\f\b\x1b")
BOMS = (
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
HTML_START = re.compile(rb"^\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)\b", re.I | re.S)
HTML_TAGS = re.compile(rb"<(html|head|body|div|p|h[1-6]|title)\b[^>]*>", re.I)
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+\S", re.M)
SETEXT_UNDERLINE = re.compile(r"^\S[^\n]*\n {0,3}(=+|-+)[ \t]*$", re.M)
RST_ADORNMENT = re.compile(r"^(\S[^\n]*)\n([=\-`:'\"~^_*+#<>])\2{2,}[ \t]*$", re.M)
MARKDOWN_SUFFIXES = (".md", ".markdown", ".mdown", ".mkd")
RST_SUFFIXES = (".rst", ".rest")


class ExtractError(ValueError):
    """A document cannot be turned into text; the message says why (for that document alone)."""


class NotText(ExtractError):
    """Bytes that are no document format we read."""


def detect_format(data: bytes, name: str = "") -> str:
    head = data[:SNIFF_BYTES]
    if b"%PDF-" in data[:1024]:
        return "pdf"
    if head.startswith(b"PK\x03\x04"):
        return _zip_format(data)
    if _looks_html(head):
        return "html"
    return "text"


def text_format(text: str, name: str = "") -> str:
    """markdown, rst or text: by the suffix when it names one, else by the headings found."""
    lower = name.lower()
    if lower.endswith(MARKDOWN_SUFFIXES):
        return "markdown"
    if lower.endswith(RST_SUFFIXES):
        return "rst"
    sample = text[:65536]
    if ATX_HEADING.search(sample):
        return "markdown"
    if RST_ADORNMENT.search(sample):
        return "rst"
    if SETEXT_UNDERLINE.search(sample):
        return "markdown"
    return "text"


def decode_text(data: bytes) -> tuple[str, str]:
    """(text, encoding): a BOM's encoding, else UTF-8, else Latin-1 (which decodes any bytes).
    Raises NotText for binary data."""
    for bom, encoding in BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding), encoding.replace("-sig", "") + " (BOM)"
            except UnicodeDecodeError as exc:
                raise NotText(f"has a {encoding} byte order mark but is not {encoding} text (byte {exc.start})")
    controls = sum(1 for byte in data[:65536] if byte < 0x20 and byte not in TEXT_CONTROLS)
    if controls > BINARY_CONTROL_SHARE * min(len(data), 65536) or b"\x00" in data:
        raise NotText("is binary data (control bytes), not UTF-8, UTF-16 or Latin-1 text")
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as exc:
        return data.decode("latin-1"), f"latin-1 (fallback: not UTF-8 at byte {exc.start})"


def _looks_html(head: bytes) -> bool:
    for bom, encoding in BOMS:
        if head.startswith(bom) and encoding.startswith("utf-16"):
            head = head.decode(encoding, "ignore").encode()
            break
    return bool(HTML_START.match(head.lstrip(codecs.BOM_UTF8))) or len(HTML_TAGS.findall(head)) >= 3


def _zip_format(data: bytes) -> str:
    try:
        names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise NotText(f"is a damaged zip archive ({exc})") from None
    if "word/document.xml" in names:
        return "docx"
    raise NotText("is a zip archive that is not a DOCX document (no word/document.xml)")
