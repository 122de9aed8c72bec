"""Documents in, text with coordinates out: PDF (fpdf2), DOCX (python-docx), HTML pages
Debian ships, Markdown, reST and text in several encodings; chunks cite the right pages and
headings; a hostile file of each kind fails alone, within its bounds. No model, no server."""

from __future__ import annotations

import codecs
import time
from pathlib import Path

import pytest
from summarize_docs import (
    PAGES,
    SECTIONS,
    TABLE,
    docx_document,
    docx_zip_bomb,
    html_nesting_bomb,
    pdf_document,
    pdf_page_tree_bomb,
    pdf_stream_bomb,
    scanned_pdf,
)

from conveyor import cli as conveyor_cli
from conveyor.apps.documents.doc_formats import detect_format
from conveyor.apps.documents.doc_layout import citation_label, citation_of, coordinates
from conveyor.apps.documents.documents import Document, document_from_bytes, load_documents
from conveyor.apps.documents.extract_worker import ExtractLimits, extract_isolated
from conveyor.apps.documents.grounding import cited_chunks, content_words
from conveyor.apps.documents.summary_points import deduplicated, finished, without_repeats
from conveyor.apps.documents.summary_prompts import Prompts, SummarizeOptions
from conveyor.apps.documents.summary_report import render
from conveyor.clients.token_counter import TokenCounter

BZIP2_MANUAL = Path("/usr/share/doc/bzip2/manual.html")
WALL_BOUND_S = ExtractLimits().wall_s + 5  # the worker's wall limit, plus starting it on a busy machine


def squash(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def counter():
    """SmolLM2's tokenizer and chat template, read as a light client reads them (no transformers)."""
    from conveyor.engine.models.loader import resolve_model_dir

    folder = resolve_model_dir("smollm2")
    return TokenCounter.from_json(
        (folder / "tokenizer.json").read_bytes(), (folder / "chat_template.jinja").read_text()
    )


def chunk_coordinates(doc: Document, counter, max_chunk_tokens: int) -> list[dict]:
    prompts = Prompts(SummarizeOptions(max_chunk_tokens=max_chunk_tokens), counter, 8192)
    return [coordinates(doc.text, doc.spans, c.start, c.end) | {"text": c.text} for c in prompts.chunks(doc)]


# ---------------------------------------------------------------- formats


def test_pdf_text_is_read_page_by_page_and_chunks_cite_their_pages(counter):
    doc = document_from_bytes(pdf_document(), "report.pdf")
    assert doc.error is None and doc.format == "pdf"
    for page, (title, text) in enumerate(PAGES, 1):
        on_page = " ".join(doc.text[s.start : s.end] for s in doc.spans if s.page == page)
        assert squash(on_page) == squash(f"{title} {text}")
    chunks = chunk_coordinates(doc, counter, max_chunk_tokens=40)
    assert len(chunks) >= 3
    for chunk in chunks:
        first, last = chunk["pages"]
        pages_holding = {
            n for n, (title, text) in enumerate(PAGES, 1) if squash(chunk["text"])[:30] in squash(f"{title} {text}")
        }
        assert pages_holding <= set(range(first, last + 1)), chunk
    assert citation_label(chunks[0]) == "p. 1" and chunks[-1]["pages"][1] == 3


def test_a_pdf_without_a_text_layer_is_refused_naming_its_page_count():
    doc = document_from_bytes(scanned_pdf(pages=3), "scan.pdf")
    assert doc.text == "" and "without a text layer on any of its 3 pages" in doc.problem()


def test_docx_headings_paragraphs_and_tables_in_order_with_heading_paths(counter):
    doc = document_from_bytes(docx_document(), "paper.docx")
    assert doc.error is None and doc.format == "docx"
    expected = [part for heading, _, text in SECTIONS for part in (heading, text)]
    expected.append("\n".join(" | ".join(row) for row in TABLE))
    assert doc.text.split("\n\n") == expected
    results = next(s for s in doc.spans if doc.text[s.start : s.end].startswith("Continuous batching"))
    assert results.headings == ("2 Methods", "2.1 Results")
    chunks = chunk_coordinates(doc, counter, max_chunk_tokens=30)  # room for about two sections
    headings = [heading for heading, _, _ in SECTIONS]
    assert len(chunks) >= 3 and all(c["text"].split("\n")[0] in headings for c in chunks[:-1])  # cut at headings
    for chunk in chunks:
        first_heading = chunk["text"].split("\n")[0]
        if first_heading in headings:
            assert citation_label(chunk) == f"§ {first_heading}"


def test_html_keeps_main_content_and_headings_without_scripts_styles_or_navigation():
    doc = document_from_bytes(BZIP2_MANUAL.read_bytes(), "manual.html")
    assert doc.error is None and doc.format == "html"
    assert "<" not in doc.text.replace("<=", "").replace("< ", "")[:2000]
    heading_paths = {s.headings for s in doc.spans if s.heading}
    assert ("2. How to use bzip2", "2.4. OPTIONS") in heading_paths
    assert "bzip2 compresses files using the Burrows-Wheeler block-sorting text compression algorithm" in squash(
        doc.text
    )
    page = (
        b"<html><head><style>p {color: red}</style><script>var secret = 1;</script></head><body>"
        b"<nav><a href='/'>Home</a> <a href='/x'>Menu item</a></nav><main><h1>Title</h1><p>Kept <b>bold</b>"
        b" text.</p><h2>Part</h2><ul><li>one</li><li>two</li></ul></main><footer>Footer links</footer>"
        b"</body></html>"
    )
    small = document_from_bytes(page, "page.html")
    assert small.text.split("\n\n") == ["Title", "Kept bold text.", "Part", "one", "two"]
    assert [s.headings for s in small.spans][-1] == ("Title", "Part")


def test_markdown_and_rest_headings_are_kept():
    markdown = "# Guide\n\nIntro.\n\n## Install\n\nRun it.\n\n```\n# not a heading\n```\n\nSetext\n------\n\nEnd.\n"
    doc = document_from_bytes(markdown.encode(), "guide.md")
    assert doc.format == "markdown"
    assert {s.headings for s in doc.spans} >= {("Guide",), ("Guide", "Install"), ("Guide", "Setext")}
    assert "# not a heading" in doc.text and ("Guide", "# not a heading") not in {s.headings for s in doc.spans}
    rest = "=====\nTitle\n=====\n\nIntro.\n\nSection\n-------\n\nBody.\n\nOther\n-----\n\nMore.\n"
    doc = document_from_bytes(rest.encode(), "notes.txt")  # told by its structure, not its suffix
    assert doc.format == "rst"
    assert [s.headings for s in doc.spans if s.heading] == [("Title",), ("Title", "Section"), ("Title", "Other")]


def test_text_encodings_are_detected_and_a_latin1_fallback_is_stated():
    text = "Café déjà vu: naïve façade.\n\nSecond paragraph."
    for data, encoding in [
        (text.encode(), "utf-8"),
        (codecs.BOM_UTF16_LE + text.encode("utf-16-le"), "utf-16 (BOM)"),
        (codecs.BOM_UTF8 + text.encode(), "utf-8 (BOM)"),
    ]:
        doc = document_from_bytes(data, "t.txt")
        assert (doc.text, doc.encoding) == (text, encoding)
    latin = document_from_bytes(text.encode("latin-1"), "t.txt")
    assert latin.text == text and latin.encoding.startswith("latin-1 (fallback: not UTF-8 at byte 3)")
    assert "binary" in document_from_bytes(b"\x89PNG\r\n\x1a\n\x00\x00", "x.txt").problem()


def test_formats_are_told_by_content_not_by_suffix(tmp_path):
    (tmp_path / "report.txt").write_bytes(pdf_document())
    (tmp_path / "page.dat").write_bytes(b"<!DOCTYPE html><html><body><p>Hello.</p></body></html>")
    (tmp_path / "paper.bin").write_bytes(docx_document())
    docs = load_documents(tmp_path)
    assert [(d.name, d.format, d.error) for d in docs] == [
        ("page.dat", "html", None),
        ("paper.bin", "docx", None),
        ("report.txt", "pdf", None),
    ]
    assert detect_format(b"%PDF-1.4 junk") == "pdf" and detect_format(b"<html><body>x</body></html>") == "html"
    assert "damaged zip" in document_from_bytes(b"PK\x03\x04junk", "a.zip").problem()


# ---------------------------------------------------------------- hostile documents


@pytest.mark.parametrize(
    "kind, make, expected",
    [
        ("pdf", lambda: pdf_stream_bomb(mib=128), "without a text layer"),
        ("pdf", lambda: pdf_page_tree_bomb(depth=20), "1048576 pages, over the limit of 2000 pages"),
        ("pdf", lambda: pdf_page_tree_bomb(depth=20, declared=1), "limit"),
        ("docx", lambda: docx_zip_bomb(mib=100), "over the limit of 200:1"),
    ],
    ids=["pdf-stream-bomb", "pdf-page-tree", "pdf-page-tree-lying-count", "docx-zip-bomb"],
)
def test_a_hostile_file_fails_alone_within_its_bounds(tmp_path, kind, make, expected):
    (tmp_path / f"a-hostile.{kind}").write_bytes(make())
    (tmp_path / "b-good.pdf").write_bytes(pdf_document())
    started = time.monotonic()
    hostile, good = load_documents(tmp_path)
    assert time.monotonic() - started < 2 * WALL_BOUND_S
    assert expected in hostile.problem() and hostile.text == ""
    assert good.problem() is None and squash(PAGES[0][1]) in squash(good.text)


def test_a_deeply_nested_html_page_with_entity_bombs_costs_little():
    started = time.monotonic()
    doc = document_from_bytes(html_nesting_bomb(depth=200_000), "bomb.html")
    assert time.monotonic() - started < WALL_BOUND_S
    assert len(doc.text) < 1000 and "lol" not in doc.text  # entities never expanded


def test_the_worker_limits_stop_a_parse_that_runs_too_long():
    data = pdf_page_tree_bomb(depth=20, declared=1)  # pypdf walks a million pages before its own cap
    with pytest.raises(ValueError, match="took longer than the limit of 0.2 s"):
        extract_isolated(data, "pdf", ExtractLimits(wall_s=0.2))
    with pytest.raises(ValueError, match="memory|could not be parsed"):
        extract_isolated(data, "pdf", ExtractLimits(memory_bytes=64 << 20))


# ---------------------------------------------------------------- points and citations


def test_summaries_end_on_a_finished_sentence_and_lose_repeats():
    assert finished("Queues hold jobs. Replicas read them and") == "Queues hold jobs."
    assert finished("No sentence end at all") == "No sentence end at all"
    looping = "The cache has blocks. The cache has blocks. The cache has many blocks. Jobs wait."
    assert deduplicated(looping) == "The cache has blocks. Jobs wait."
    assert without_repeats(["A queue holds jobs.", "The queue holds all jobs!"]) == ["A queue holds jobs."]


def test_points_cite_only_the_chunks_they_are_grounded_in():
    chunks = ["Producers put jobs on a Redis stream.", "Replicas batch decoding steps.", "The cache has fixed blocks."]
    words = [content_words(c) for c in chunks]
    assert cited_chunks("Jobs wait on a Redis stream for producers.", words) == [0]
    assert cited_chunks("Decoding steps are batched by replicas; the cache has fixed blocks.", words) == [1, 2]
    assert cited_chunks("The moon is made of green cheese.", words) == []  # never "all chunks"
    chunks = [{"pages": [1, 2]}, {"pages": [2, 3]}, {"pages": [7, 7]}]
    assert citation_of(chunks) == "p. 1-3, 7"
    assert citation_of([{"pages": None, "headings": ["2 Methods", "2.1 Results"], "lines": [1, 2]}]) == "§ 2.1 Results"


def test_the_report_escapes_every_text_it_shows():
    hostile = "<script>alert('x')</script>"
    records = [
        {
            "document": hostile,
            "status": "done",
            "format": "html",
            "points": [{"text": hostile, "chunks": [0], "cite": f"§ {hostile}"}],
            "chunks": [{"index": 0, "cite": f"§ {hostile}", "summary": hostile}],
            "tree": [{"level": 1, "index": 0, "inputs": [0], "cite": hostile, "summary": hostile}],
        },
        {"document": "bad.pdf", "status": "error", "error": f"bad.pdf {hostile}"},
    ]
    page = render(records)
    assert "<script" not in page and page.count("&lt;script&gt;") == 8
    assert "href='#d0-c0'" in page and "id='d0-c0'" in page and "1 failed" in page


def test_cli_refuses_bad_schema_files_and_needs_paths_or_watch(tmp_path, capsys):
    from conveyor.clients import cli

    base = ["summarize", "--out", str(tmp_path / "out"), "--redis-url", "redis://127.0.0.1:1", "--quiet"]
    assert conveyor_cli.main(base) == cli.EXIT_USAGE
    assert "give PATH arguments or --watch INBOX" in capsys.readouterr().err
    assert conveyor_cli.main([*base, "a.txt", "--schema", str(tmp_path / "missing.json")]) == cli.EXIT_USAGE
    assert "--schema" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"type": 5}')
    assert conveyor_cli.main([*base, "a.txt", "--schema", str(tmp_path / "bad.json")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid option schema" in err and "not a valid JSON schema" in err
