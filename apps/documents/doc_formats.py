"""What a file is, told by its bytes (magic numbers, then structure), and its text decoded.

Formats: pdf, docx, html, markdown, rst, text. The file's suffix only breaks ties between
the text formats (a README.md without any heading is still Markdown).

Everything here reads untrusted bytes in the summarizer's own process, so every step runs
in linear time: HTML is sniffed by a forward scan (a backtracking pattern such as
`(<!--.*?-->\\s*)*` takes exponential time on `<!---->` repeated 40 times), and the heading
patterns are anchored at line starts and repeat no group, so each line start costs at most
that line and the next (tests/test_documents_hardening.py times them on hostile input)."""

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
HTML_START_TAGS = (b"html", b"head", b"body")  # or <!doctype html, after spaces and comments
HTML_TAGS = frozenset({b"html", b"head", b"body", b"div", b"p", b"title", *(b"h%d" % n for n in range(1, 7))})
HTML_TAGS_NEEDED = 3  # tags of HTML_TAGS (each closed by a '>') anywhere in the head
SPACE_BYTES = b" \t\n\r\f\v"  # what \s matches in a bytes pattern
WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
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
    lower = head.lower()  # ASCII case folding, as re.I on bytes
    return _starts_html(lower.lstrip(codecs.BOM_UTF8)) or _html_tags(lower) >= HTML_TAGS_NEEDED


def _starts_html(lower: bytes) -> bool:
    """Whether `lower` opens, after whitespace and complete comments, with `<!doctype html`,
    `<html`, `<head` or `<body` (then a non-word byte). One forward pass: a comment ends at
    the first `-->` after it (as in HTML), so no byte is looked at twice."""
    at = 0
    while True:
        at = _skip_spaces(lower, at)
        if not lower.startswith(b"<!--", at):
            break
        end = lower.find(b"-->", at + 4)
        if end < 0:
            return False
        at = end + 3
    if lower.startswith(b"<!doctype", at):
        name = _skip_spaces(lower, at + 9)
        return name > at + 9 and lower.startswith(b"html", name) and _word_ends(lower, name + 4)
    return any(lower.startswith(b"<" + tag, at) and _word_ends(lower, at + 1 + len(tag)) for tag in HTML_START_TAGS)


def _html_tags(lower: bytes) -> int:
    """How many tags of HTML_TAGS, each closed by a '>', `lower` holds (up to HTML_TAGS_NEEDED),
    counted as `<(name)\\b[^>]*>` finds them, without overlap, in one forward pass."""
    count, at = 0, lower.find(b"<")
    while at >= 0 and count < HTML_TAGS_NEEDED:
        name_end = _tag_name_end(lower, at + 1)
        if name_end is None:
            at = lower.find(b"<", at + 1)
            continue
        close = lower.find(b">", name_end)
        if close < 0:
            break  # no '>' left: no later tag is closed either
        count += 1
        at = lower.find(b"<", close + 1)
    return count


def _tag_name_end(lower: bytes, start: int) -> int | None:
    end = start
    while end < len(lower) and lower[end] in WORD_BYTES and end - start < 5:  # "title" is the longest name
        end += 1
    return end if lower[start:end] in HTML_TAGS and _word_ends(lower, end) else None


def _skip_spaces(data: bytes, at: int) -> int:
    while at < len(data) and data[at] in SPACE_BYTES:
        at += 1
    return at


def _word_ends(data: bytes, at: int) -> bool:
    """What \\b means after a word byte: the end, or a byte that is not a word byte."""
    return at >= len(data) or data[at] not in WORD_BYTES


def _zip_format(data: bytes) -> str:
    try:
        names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise NotText(f"is a damaged zip archive ({exc})") from None
    if "word/document.xml" in names:
        return "docx"
    raise NotText("is a zip archive that is not a DOCX document (no word/document.xml)")
