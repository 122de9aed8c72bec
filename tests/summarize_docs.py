"""Documents the summarization tests make: real PDFs (fpdf2) and DOCX files (python-docx)
with known text per page and heading, and hostile files of each kind (built by hand, small
on disk, crafted to blow up a naive parser)."""

from __future__ import annotations

import io
import zipfile
import zlib

PAGES = [
    (
        "Queues",
        "Producers put generation jobs on a Redis stream. Each job waits in the stream until a replica "
        "reads it. The stream keeps jobs safe while replicas restart.",
    ),
    (
        "Batching",
        "Replicas batch jobs at the level of single decoding steps. Finished sequences leave the batch "
        "and waiting ones join it at every step.",
    ),
    (
        "Caching",
        "The key value cache is a pool of fixed blocks. Each sequence maps its logical blocks to "
        "physical blocks, so memory is not fragmented.",
    ),
]
SECTIONS = [
    ("1 Introduction", 1, "Conveyor serves language models from a message queue."),
    ("2 Methods", 1, "We measured throughput on two processor cores."),
    ("2.1 Results", 2, "Continuous batching doubled the tokens per second of dynamic batching."),
    ("3 Discussion", 1, "Small models repeat themselves when their input is long."),
]
TABLE = [["model", "tokens per second"], ["SmolLM2", "41"], ["Llama", "12"]]


def pdf_document(pages=PAGES) -> bytes:
    """One page per (title, text), each page's text only on that page."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for title, text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, title)
        pdf.ln(4)
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def scanned_pdf(pages: int = 3) -> bytes:
    """Pages with only a drawing on them: no text layer (as a scan without OCR)."""
    from fpdf import FPDF

    pdf = FPDF()
    for _ in range(pages):
        pdf.add_page()
        pdf.rect(20, 20, 100, 60, style="F")
    return bytes(pdf.output())


def docx_document() -> bytes:
    import docx

    document = docx.Document()
    for heading, level, text in SECTIONS:
        document.add_heading(heading, level=level)
        document.add_paragraph(text)
    table = document.add_table(rows=len(TABLE), cols=2)
    for row, values in zip(table.rows, TABLE):
        for cell, value in zip(row.cells, values):
            cell.text = value
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- hostile files


def raw_pdf(objects: list[bytes]) -> bytes:
    """A PDF of these objects (1 0 obj is the catalog) with a correct cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % offset for offset in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def deflated_spaces(mib: int) -> bytes:
    """`mib` MiB of spaces, deflated (about 1000:1), made without holding them in memory."""
    compressor, block = zlib.compressobj(9), b" " * (1 << 20)
    return b"".join(compressor.compress(block) for _ in range(mib)) + compressor.flush()


def pdf_stream_bomb(mib: int = 512) -> bytes:
    """One page whose content stream inflates to `mib` MiB."""
    data = deflated_spaces(mib)
    return raw_pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
            b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(data), data),
        ]
    )


def pdf_page_tree_bomb(depth: int = 20, declared: int | None = None) -> bytes:
    """2**depth pages from `depth` objects: each page-tree node lists its child twice.
    `declared` is the /Count the nodes claim (default: the true count)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    for level in range(depth):
        child, count = 3 + level, declared if declared is not None else 2 ** (depth - level)
        objects.append(b"<< /Type /Pages /Kids [%d 0 R %d 0 R] /Count %d >>" % (child, child, count))
    objects.append(b"<< /Type /Page /MediaBox [0 0 612 792] >>")
    return raw_pdf(objects)


def docx_zip_bomb(mib: int = 100) -> bytes:
    """A DOCX whose word/document.xml inflates to `mib` MiB (ratio about 1000:1)."""
    good = zipfile.ZipFile(io.BytesIO(docx_document()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bomb:
        for item in good.infolist():
            if item.filename != "word/document.xml":
                bomb.writestr(item, good.read(item))
        with bomb.open("word/document.xml", "w", force_zip64=True) as member:
            block = b" " * (1 << 20)
            for _ in range(mib):
                member.write(block)
    return out.getvalue()


def html_nesting_bomb(depth: int = 200_000) -> bytes:
    """A page nested `depth` elements deep, with entity declarations that would expand to
    gigabytes in an XML parser that expands them (billion laughs)."""
    entities = "".join(f'<!ENTITY e{i} "{f"&e{i - 1};" * 10}">' for i in range(1, 10))
    head = f'<!DOCTYPE html [<!ENTITY e0 "lol">{entities}]><html><body><p>&e9;</p>'
    return (head + "<div>" * depth + "deep text" + "</div>" * depth + "</body></html>").encode()
