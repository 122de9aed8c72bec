"""Parse one untrusted PDF, DOCX or HTML file in a child process under hard limits, so a
document crafted to blow up (decompression bombs, deep nesting, a huge page tree) costs
that document alone a bounded amount of memory and time and never the pipeline.

Bounds, per document (`ExtractLimits`): address space (RLIMIT_AS, default 1 GiB), CPU time
(RLIMIT_CPU, default 20 s), wall clock (default 30 s, then SIGKILL), and the text it may
return (default 16 M characters). Each format adds its own checks inside: the page cap of
extract_pdf, the zip checks of extract_docx, lxml's default limits in extract_html.

The child loads only the extraction modules (`conveyor`, `conveyor.apps` and
`conveyor.apps.documents` import nothing themselves, so the client, redis and pydantic stay
out of it: they would cost more than parsing most files).
Arguments: KIND MAX_BYTES CPU_S MAX_CHARS; the file on stdin, a msgpack reply on stdout.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from dataclasses import dataclass

import msgpack

from conveyor.apps.documents.doc_formats import ExtractError
from conveyor.apps.documents.doc_layout import Block

ISOLATED_FORMATS = ("pdf", "docx", "html")
CHILD_MAIN = "import sys; from conveyor.apps.documents.extract_worker import main; main(sys.argv[1:])"


@dataclass(frozen=True)
class ExtractLimits:
    memory_bytes: int = 1 << 30
    cpu_s: int = 20
    wall_s: float = 30.0
    max_chars: int = 16_000_000


def extract_isolated(data: bytes, kind: str, limits: ExtractLimits = ExtractLimits()) -> list[Block]:
    """The blocks of `data` (a `kind` document), parsed in a child process under `limits`."""
    assert kind in ISOLATED_FORMATS, kind
    command = [
        sys.executable,
        *(["-P"] if sys.version_info >= (3, 11) else []),  # no current directory on sys.path
        "-c",
        CHILD_MAIN,
        kind,
        str(limits.memory_bytes),
        str(limits.cpu_s),
        str(limits.max_chars),
    ]
    try:
        done = subprocess.run(command, input=data, capture_output=True, timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        raise ExtractError(f"took longer than the limit of {limits.wall_s:g} s to parse (stopped)") from None
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not done.stdout:
        raise ExtractError(f"needed more than the limit of {limits.cpu_s} s of CPU to parse (stopped)")
    try:
        reply = msgpack.unpackb(done.stdout) if done.stdout else None
    except (ValueError, msgpack.UnpackException):
        reply = None
    if not isinstance(reply, dict):
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ExtractError(f"could not be parsed: the parser process failed ({last[0][:200]})")
    if "error" in reply:
        raise ExtractError(str(reply["error"]))
    return [Block(text, page, level) for text, page, level in reply["blocks"]]


def extract_blocks(data: bytes, kind: str) -> list[Block]:
    """The blocks of a document, parsed in this process (the worker's side)."""
    if kind == "pdf":
        from conveyor.apps.documents.extract_pdf import pdf_blocks

        return pdf_blocks(data)
    if kind == "docx":
        from conveyor.apps.documents.extract_docx import docx_blocks

        return docx_blocks(data)
    from conveyor.apps.documents.extract_html import html_blocks

    return html_blocks(data)


def _worker(kind: str, memory_bytes: int, cpu_s: int, max_chars: int) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    data = sys.stdin.buffer.read()
    try:
        blocks = extract_blocks(data, kind)
    except ExtractError as exc:
        return {"error": str(exc)}
    except MemoryError:
        return {"error": f"needed more than the limit of {memory_bytes >> 20} MiB of memory to parse (stopped)"}
    except RecursionError:
        return {"error": "is nested too deeply to parse"}
    chars = sum(len(b.text) for b in blocks)
    if chars > max_chars:
        return {"error": f"holds {chars} characters of text, over the limit of {max_chars}"}
    return {"blocks": [[b.text, b.page, b.level] for b in blocks]}


def main(argv: list[str]) -> None:
    kind, memory, cpu, chars = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    try:
        reply = _worker(kind, memory, cpu, chars)
    except MemoryError:
        reply = {"error": f"needed more than the limit of {memory >> 20} MiB of memory to parse (stopped)"}
    except Exception as exc:  # a parser's own bug on a crafted file: that document's error
        reply = {"error": f"could not be parsed ({type(exc).__name__}: {str(exc)[:200]})"}
    sys.stdout.buffer.write(msgpack.packb(reply))
