"""Blocks of an HTML page: its main content (<main>, <article> or role=main, else <body>)
without navigation, scripts, styles and forms; headings h1-h6 kept with their level (lxml).

The parser never fetches anything, keeps no comments and has libxml2's default limits on
(no huge_tree: depth and text node sizes bounded); HTML has no entity declarations to
expand. The walk is iterative, so a deeply nested page cannot overflow the stack."""

from __future__ import annotations

from lxml import etree

from conveyor.apps.documents.doc_formats import ExtractError
from conveyor.apps.documents.doc_layout import Block

DROPPED = frozenset(
    {
        "script",
        "style",
        "noscript",
        "template",
        "nav",
        "header",
        "footer",
        "aside",
        "form",
        "iframe",
        "svg",
        "math",
        "button",
        "select",
        "head",
        "object",
        "canvas",
    }
)
HEADINGS = {f"h{n}": n for n in range(1, 7)}
BLOCK_TAGS = frozenset(
    {
        "p",
        "div",
        "section",
        "article",
        "main",
        "li",
        "ul",
        "ol",
        "dl",
        "dt",
        "dd",
        "pre",
        "blockquote",
        "table",
        "tr",
        "caption",
        "figcaption",
        "figure",
        "address",
        "hr",
        "center",
        "body",
        "td",
        "th",
    }
    | set(HEADINGS)
)
MAIN_XPATH = "//main | //article | //*[@role='main']"


def html_blocks(data: bytes) -> list[Block]:
    parser = etree.HTMLParser(remove_comments=True, remove_pis=True, no_network=True, huge_tree=False)
    try:
        root = etree.fromstring(data, parser)
    except (etree.ParserError, etree.XMLSyntaxError, ValueError) as exc:
        raise ExtractError(f"is an HTML page that cannot be parsed ({exc})") from None
    if root is None:
        raise ExtractError("is an HTML page with no content")
    mains = root.xpath(MAIN_XPATH)
    return _walk(mains[0] if mains else (root.find("body") if root.find("body") is not None else root))


def _walk(top) -> list[Block]:
    blocks: list[Block] = []
    words: list[str] = []
    level = 0  # of the heading being read, 0 outside headings
    pre = 0  # depth inside <pre>

    def flush() -> None:
        text = "".join(words)
        text = text.strip("\n") if pre else " ".join(text.split())
        if text.strip():
            blocks.append(Block(text, level=level))
        words.clear()

    walker = etree.iterwalk(top, events=("start", "end"))
    for event, element in walker:
        tag = element.tag if isinstance(element.tag, str) else ""
        if event == "start":
            if tag in DROPPED:
                walker.skip_subtree()
                continue
            if tag in BLOCK_TAGS:
                flush()
                level = HEADINGS.get(tag, level)
                pre += tag == "pre"
            if tag == "br":
                words.append("\n" if pre else " ")
            words.append(element.text or "")
        else:
            if tag in BLOCK_TAGS and tag not in DROPPED:
                flush()
                level = 0 if tag in HEADINGS else level
                pre -= tag == "pre"
            if element is not top:
                words.append(element.tail or "")
    flush()
    return blocks
