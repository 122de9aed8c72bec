"""Documents of a summarization run: reading files and folders, naming the outputs.

Paths are handled defensively, because input folders and output folders may hold
symbolic links that someone else planted:

- Reading: inside an input folder, every folder and file is opened relative to its
  parent's descriptor with O_NOFOLLOW, so no symlink below the folder is followed, not
  even one swapped in while the folder is walked, and what was opened is checked (fstat:
  a regular file), not the path. `list_files` and `read_inside` do the same for a file
  listed once and read later (`--watch`), one path component at a time. A path the
  caller names is followed.
- Printing: `printable` escapes control characters in names before they reach a terminal.
- Naming: every document name becomes a safe relative path (`safe_name`).
- Writing: each output is written to a temporary file in its folder and renamed over the
  target, so a symlink already there is replaced, never written through; folders inside
  the output folder are entered with O_NOFOLLOW, and a symlinked one is refused.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import secrets
import stat
import unicodedata
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

from conveyor.apps.documents.doc_formats import ExtractError, decode_text, detect_format, text_format
from conveyor.apps.documents.doc_layout import Span, assemble
from conveyor.apps.documents.extract_markup import text_blocks
from conveyor.apps.documents.extract_worker import ISOLATED_FORMATS, extract_isolated

# Folders nested deeper than this under an input folder are reported, not read (each level
# holds one open descriptor and one stack frame while the walk is below it).
MAX_FOLDER_DEPTH = 64
# Unicode categories replaced in names: control (NUL, newline, ESC...), format (such as the
# right-to-left override) and surrogates (undecodable bytes of a file name).
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
UNNAMED = "unnamed"


MAX_DOCUMENT_BYTES = 64 << 20  # a larger file is refused before it is read


@dataclass(frozen=True)
class Document:
    """One text to summarize. `name` is unique in a run and names its output files;
    `error` says why the text could not be read (then `text` is empty). `spans` say where
    each paragraph of `text` came from (page, heading path: see doc_layout); `encoding`
    how a text file was decoded."""

    name: str
    text: str = ""
    source: str | None = None
    error: str | None = None
    format: str = "text"
    spans: tuple[Span, ...] = ()
    encoding: str | None = None

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


class SkippedFile(OSError):
    """A path inside an input folder that is not read: not a regular file, or a symbolic
    link (to it or to a folder on its way) that is not followed."""


class UnsafeOutputPath(ValueError):
    """A document's outputs would land outside the output folder or go through a symlink."""


# ---------------------------------------------------------------- reading


def load_documents(sources: str | Path | Document | Iterable[str | Path | Document]) -> list[Document]:
    """Documents from file paths, folders and Document objects, in order, with unique, safe names.

    Folders are read recursively and keep their structure in the names (`a/b.txt`). Hidden
    files and folders (names starting with a dot) are skipped silently. A symlink anywhere
    under a folder (to a file or to a folder) is not followed: it becomes a Document whose
    `error` says it was skipped, as does anything that is not a regular file (a FIFO, a
    socket, a device). A path given in `sources` may itself be a symlink, to a file or a
    folder: the caller named it, so it is followed.

    Names are sanitized, not refused: see `safe_name` (a Document named `../../x` is
    summarized as `__/__/x`).
    """
    if isinstance(sources, (str, Path, Document)):
        sources = [sources]
    documents: list[Document] = []
    for source in sources:
        if isinstance(source, Document):
            documents.append(source)
        elif Path(source).is_dir():
            documents.extend(_folder_documents(Path(source)))
        else:
            documents.append(read_document(Path(source), Path(source).name))
    return _unique_names([dataclasses.replace(doc, name=safe_name(doc.name)) for doc in documents])


def read_document(path: Path, name: str, *, dir_fd: int | None = None) -> Document:
    """The text of one regular file (any format of `document_from_bytes`), or a Document
    saying why it cannot be read.

    Without `dir_fd`, `path` is opened as given (a symlink the caller named is followed).
    With `dir_fd`, the file `path.name` is opened inside that folder and never through a
    symlink; `path` then only names it in messages.
    """
    try:
        data = _read_regular_file(path if dir_fd is None else path.name, dir_fd)
    except SkippedFile as exc:
        return Document(name, source=str(path), error=f"skipped {path}: {exc}")
    except OSError as exc:
        if dir_fd is not None and exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink swapped in
            return _symlink_skipped(path, name)
        return Document(name, source=str(path), error=f"cannot read {path}: {exc.strerror or exc}")
    return document_from_bytes(data, name, str(path))


def document_from_bytes(data: bytes, name: str, source: str | None = None) -> Document:
    """A Document of PDF, DOCX, HTML, Markdown, reST or plain text bytes, told apart by
    content (doc_formats). PDF, DOCX and HTML are parsed in a worker process under limits
    (extract_worker); every failure is that document's error, naming it."""
    label = source or name
    try:
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ExtractError(f"is {len(data)} bytes, over the limit of {MAX_DOCUMENT_BYTES} bytes")
        kind = detect_format(data, name)
        encoding = None
        if kind in ISOLATED_FORMATS:
            blocks = extract_isolated(data, kind)
        else:
            text, encoding = decode_text(data)
            kind = text_format(text, name)
            blocks = text_blocks(text, kind)
    except ExtractError as exc:
        return Document(name, source=source, error=f"{label} {exc}")
    text, spans = assemble(blocks)
    return Document(name, text, source=source, format=kind, spans=spans, encoding=encoding)


def _read_regular_file(path: str | Path, dir_fd: int | None) -> bytes:
    # O_NONBLOCK: opening a FIFO must not hang; fstat then refuses it (and devices).
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if dir_fd is not None else 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SkippedFile("not a regular file")
        return file.read(MAX_DOCUMENT_BYTES + 1)  # one byte over tells the limit was passed


def _folder_documents(root: Path) -> list[Document]:
    """The documents under `root`, named by their path relative to it, in sorted order."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # root itself: named by the caller
    except OSError as exc:
        return [Document(root.name, source=str(root), error=f"cannot read folder {root}: {exc.strerror or exc}")]
    try:
        return list(_walk(fd, root, PurePosixPath(), 1))
    finally:
        os.close(fd)


def _walk(dir_fd: int, root: Path, folder: PurePosixPath, depth: int) -> Iterator[Document]:
    """Depth first, entries sorted by name: the order of sorting the relative paths."""
    try:
        with os.scandir(dir_fd) as scan:
            entries = sorted((e for e in scan if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as exc:
        path = root / folder
        yield Document(folder.as_posix(), source=str(path), error=f"cannot read folder {path}: {exc.strerror or exc}")
        return
    for entry in entries:
        relative = folder / entry.name
        path, name = root / relative, relative.as_posix()
        if entry.is_symlink():
            yield _symlink_skipped(path, name)
        elif entry.is_dir(follow_symlinks=False):
            yield from _walk_subfolder(dir_fd, entry.name, root, relative, depth + 1)
        elif entry.is_file(follow_symlinks=False):
            yield read_document(path, name, dir_fd=dir_fd)
        else:
            yield Document(name, source=str(path), error=f"skipped {path}: not a regular file")


def _walk_subfolder(parent_fd: int, entry: str, root: Path, folder: PurePosixPath, depth: int) -> Iterator[Document]:
    path, name = root / folder, folder.as_posix()
    if depth > MAX_FOLDER_DEPTH:
        yield Document(name, source=str(path), error=f"skipped {path}: folders nested deeper than {MAX_FOLDER_DEPTH}")
        return
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as exc:
        if _is_symlink(entry, parent_fd):  # swapped for a symlink after the scan
            yield _symlink_skipped(path, name)
        else:
            yield Document(name, source=str(path), error=f"cannot read folder {path}: {exc.strerror or exc}")
        return
    try:
        yield from _walk(fd, root, folder, depth)
    finally:
        os.close(fd)


SYMLINK_SKIPPED = "it is a symbolic link (links inside input folders are not followed)"


def _symlink_skipped(path: Path, name: str) -> Document:
    return Document(name, source=str(path), error=f"skipped {path}: {SYMLINK_SKIPPED}")


def list_files(root: Path) -> list[tuple[str, tuple[int, int]]]:
    """(name relative to `root`, (size, mtime_ns)) of each regular file under `root`, sorted
    by folder then name; hidden names, symlinks and anything else skipped silently. Folders
    are entered like `load_documents` enters them (by descriptor, O_NOFOLLOW), so a folder
    swapped for a symlink while the walk runs is not listed through. `root` is followed."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        return list(_list(fd, PurePosixPath(), 1))
    finally:
        os.close(fd)


def _list(dir_fd: int, folder: PurePosixPath, depth: int) -> Iterator[tuple[str, tuple[int, int]]]:
    try:
        with os.scandir(dir_fd) as scan:
            entries = sorted((e for e in scan if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            yield (folder / entry.name).as_posix(), (info.st_size, info.st_mtime_ns)
        elif stat.S_ISDIR(info.st_mode) and depth < MAX_FOLDER_DEPTH:
            try:
                fd = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                yield from _list(fd, folder / entry.name, depth + 1)
            finally:
                os.close(fd)


def read_inside(root: Path, name: str) -> bytes:
    """The bytes of the regular file `name` ('/'-separated, relative) inside the folder
    `root`, read without following any symbolic link below `root`, whatever was swapped in
    since `name` was listed: each folder on the way is opened relative to its parent's
    descriptor with O_DIRECTORY | O_NOFOLLOW, the file with O_NOFOLLOW, and fstat must say
    a regular file. `root` itself is followed (the caller named it).

    Raises SkippedFile for a symlink on the way or a file that is not regular, OSError when
    reading fails, ValueError for a name that is not a plain relative path."""
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"not a relative path inside a folder: {name!r}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                if _is_symlink(part, fd):
                    raise SkippedFile(
                        f"the folder '{part}' on its way is a symbolic link (links inside input folders are not followed)"
                    ) from None
                raise
            os.close(fd)
            fd = child
        try:
            return _read_regular_file(parts[-1], fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SkippedFile(SYMLINK_SKIPPED) from None
            raise
    finally:
        os.close(fd)


def _is_symlink(entry: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(entry, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------- naming


def safe_name(name: str) -> str:
    """`name` as a safe relative path for output files, sanitized rather than refused.

    The name is split on '/'; empty and '.' parts are dropped (so an absolute name becomes
    relative: '/etc/x' -> 'etc/x'); in each other part, control and format characters
    (NUL, newline, ESC, right-to-left override...) and each leading dot become '_' ('..' ->
    '__', '.bashrc' -> '_bashrc'), so no part climbs out or hides a file. Safe names such as
    'a/b.txt' are unchanged; a name with nothing left becomes 'unnamed'.
    """
    parts = [_safe_part(part) for part in name.split("/") if part not in ("", ".")]
    return "/".join(parts) or UNNAMED


def printable(text: str) -> str:
    """`text` safe to print on a terminal: each character Python would not print as itself
    (controls such as ESC and newline, format characters such as the right-to-left override,
    surrogates standing for undecodable bytes of a file name) is shown escaped as repr
    writes it (`\\x1b`, `\\n`, `\\u202e`, `\\udcff`), and a backslash as two, so no
    name can move the cursor, recolour the terminal, retitle it or forge a line."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escaped(char) for char in text)


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    return char if char.isprintable() else repr(char)[1:-1]


def _safe_part(part: str) -> str:
    part = "".join("_" if unicodedata.category(char) in UNSAFE_CATEGORIES else char for char in part)
    visible = part.lstrip(".")
    return "_" * (len(part) - len(visible)) + visible


def _unique_names(documents: list[Document]) -> list[Document]:
    used: set[str] = set()
    unique = []
    for doc in documents:
        name, count = doc.name, 1
        while name in used:
            count += 1
            name = f"{doc.name}-{count}"
        used.add(name)
        unique.append(doc if name == doc.name else dataclasses.replace(doc, name=name))
    return unique


# ---------------------------------------------------------------- writing


def summary_path(out_dir: Path, doc: Document) -> Path:
    return out_dir / f"{doc.name}.summary.txt"


def record_path(out_dir: Path, doc: Document) -> Path:
    return out_dir / f"{doc.name}.summary.json"


def write_outputs(out_dir: Path, doc: Document, summary: str | None, record: dict[str, Any]) -> None:
    """The summary file (when there is a summary) and the JSON record of one document.

    Each file is written to a temporary file in its folder, then renamed over the target:
    readers never see half a file, and a symlink at the target is replaced, not written
    through. `out_dir` itself may be a symlink (the caller chose it); folders inside it are
    created or entered without following symlinks. Raises UnsafeOutputPath when the name is
    not one `safe_name` leaves unchanged, when the outputs would resolve outside `out_dir`
    or when a folder on the way inside it is a symlink; OSError when writing fails.
    """
    folders = _output_folders(out_dir, doc)
    with _output_folder(out_dir, folders) as dir_fd:
        if summary is not None:
            _replace_file(dir_fd, summary_path(out_dir, doc).name, summary + "\n")
        _replace_file(dir_fd, record_path(out_dir, doc).name, json.dumps(record, indent=2) + "\n")


def write_top_file(out_dir: Path, name: str, text: str) -> None:
    """Write `out_dir/name` (a report) the way outputs are written: temporary file, rename."""
    with _output_folder(out_dir, []) as dir_fd:
        _replace_file(dir_fd, name, text)


def _output_folders(out_dir: Path, doc: Document) -> list[str]:
    """The folders, inside `out_dir`, that hold this document's outputs, once checked."""
    if safe_name(doc.name) != doc.name:
        raise UnsafeOutputPath(f"unsafe document name {doc.name!r} (it would be written as {safe_name(doc.name)!r})")
    # Last line of defence: compare resolved paths, whatever the checks above missed.
    base, target = out_dir.resolve(), summary_path(out_dir, doc).parent.resolve()
    if not target.is_relative_to(base):
        raise UnsafeOutputPath(f"the outputs of {doc.name!r} would be written to {target}, outside {base}")
    return doc.name.split("/")[:-1]


@contextmanager
def _output_folder(out_dir: Path, folders: list[str]) -> Iterator[int]:
    """A descriptor of out_dir/folders..., each folder created if missing, none a symlink."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, folder in enumerate(folders, 1):
            child = _enter_output_folder(fd, folder, out_dir.joinpath(*folders[:depth]))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _enter_output_folder(parent_fd: int, folder: str, path: Path) -> int:
    with suppress(FileExistsError):
        os.mkdir(folder, dir_fd=parent_fd)
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:
        if _is_symlink(folder, parent_fd):
            raise UnsafeOutputPath(f"{path} is a symbolic link; outputs are not written through links") from None
        raise


def _replace_file(dir_fd: int, name: str, text: str) -> None:
    """Write `name` in the folder `dir_fd` through a fresh temporary file and a rename."""
    temporary = f".conveyor-{secrets.token_hex(8)}.tmp"  # short: `name` may be near NAME_MAX
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with open(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
