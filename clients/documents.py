"""Documents of a summarization run: reading files and folders, naming the outputs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


@dataclass(frozen=True)
class Document:
    """One text to summarize. `name` is unique in a run and names its output files;
    `error` says why the text could not be read (then `text` is empty)."""

    name: str
    text: str = ""
    source: str | None = None
    error: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def problem(self) -> str | None:
        """Why this document cannot be summarized, if it cannot."""
        if self.error:
            return self.error
        if not self.text.strip():
            return "document is empty (no text to summarize)"
        return None


def load_documents(sources: str | Path | Document | Iterable[str | Path | Document]) -> list[Document]:
    """Documents from file paths, folders (their files, recursively, hidden ones skipped)
    and Document objects, in order, with unique names."""
    if isinstance(sources, (str, Path, Document)):
        sources = [sources]
    documents: list[Document] = []
    for source in sources:
        if isinstance(source, Document):
            documents.append(source)
        elif Path(source).is_dir():
            root = Path(source)
            documents.extend(read_document(p, p.relative_to(root).as_posix()) for p in _files_under(root))
        else:
            documents.append(read_document(Path(source), Path(source).name))
    return _unique_names(documents)


def read_document(path: Path, name: str) -> Document:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        return Document(name, source=str(path), error=f"cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        return Document(name, source=str(path), error=f"{path} is not UTF-8 text (byte {exc.start})")
    if "\x00" in text:
        return Document(name, source=str(path), error=f"{path} looks binary (it holds NUL bytes)")
    return Document(name, text, source=str(path))


def _files_under(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )  # fmt: skip


def _unique_names(documents: list[Document]) -> list[Document]:
    used: set[str] = set()
    unique = []
    for doc in documents:
        name, count = doc.name, 1
        while name in used:
            count += 1
            name = f"{doc.name}-{count}"
        used.add(name)
        unique.append(doc if name == doc.name else Document(name, doc.text, doc.source, doc.error))
    return unique


def summary_path(out_dir: Path, doc: Document) -> Path:
    return out_dir / f"{doc.name}.summary.txt"


def record_path(out_dir: Path, doc: Document) -> Path:
    return out_dir / f"{doc.name}.summary.json"


def write_outputs(out_dir: Path, doc: Document, summary: str | None, record: dict[str, Any]) -> None:
    """The summary file (when there is a summary) and the JSON record of one document."""
    target = summary_path(out_dir, doc)
    target.parent.mkdir(parents=True, exist_ok=True)
    if summary is not None:
        target.write_text(summary + "\n", encoding="utf-8")
    record_path(out_dir, doc).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
