"""Paths of `conveyor summarize`: symlinks in input folders, unsafe document names and
symlinks in the output folder. Real files and real symlinks in tmp_path; no model."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from conveyor import cli as conveyor_cli
from conveyor.apps.documents.documents import (
    Document,
    UnsafeOutputPath,
    load_documents,
    read_document,
    record_path,
    safe_name,
    summary_path,
    write_outputs,
)
from conveyor.clients import cli

SECRET = "TOP SECRET: must never reach the model"
RECORD = {"status": "done"}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def by_name(docs: list[Document]) -> dict[str, Document]:
    return {doc.name: doc for doc in docs}


def outputs_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def outside(tmp_path):
    """A folder outside the input and output folders, holding a secret file."""
    write(tmp_path / "outside" / "secret.txt", SECRET)
    return tmp_path / "outside"


# ---------------------------------------------------------------- defect 1: symlinks in input folders


def test_a_symlinked_file_inside_a_folder_is_skipped_as_an_error(tmp_path, outside):
    write(tmp_path / "docs" / "a.txt", "alpha")
    os.symlink(outside / "secret.txt", tmp_path / "docs" / "passwd")
    os.symlink("/etc/passwd", tmp_path / "docs" / "etc-passwd")
    os.symlink(tmp_path / "nowhere", tmp_path / "docs" / "dangling")
    docs = by_name(load_documents(tmp_path / "docs"))
    assert sorted(docs) == ["a.txt", "dangling", "etc-passwd", "passwd"]
    assert docs["a.txt"].text == "alpha" and docs["a.txt"].problem() is None
    for name in ("passwd", "etc-passwd", "dangling"):
        assert docs[name].text == "" and "symbolic link" in docs[name].problem(), name
    assert all(SECRET not in doc.text and "root:" not in doc.text for doc in docs.values())


def test_a_symlinked_folder_inside_a_folder_is_not_entered(tmp_path, outside):
    write(tmp_path / "docs" / "sub" / "b.txt", "beta")
    os.symlink(outside, tmp_path / "docs" / "sub" / "linked")
    os.symlink(tmp_path / "docs", tmp_path / "docs" / "loop")  # would recurse forever if followed
    docs = by_name(load_documents(tmp_path / "docs"))
    assert sorted(docs) == ["loop", "sub/b.txt", "sub/linked"]
    assert "symbolic link" in docs["sub/linked"].error and "symbolic link" in docs["loop"].error
    assert docs["sub/linked"].source == str(tmp_path / "docs" / "sub" / "linked")


def test_a_file_swapped_for_a_symlink_is_not_read_through_it(tmp_path, outside):
    # What the walk does once it has scanned a folder: open the entry with O_NOFOLLOW in it.
    os.symlink(outside / "secret.txt", tmp_path / "swapped.txt")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        doc = read_document(tmp_path / "swapped.txt", "swapped.txt", dir_fd=fd)
    finally:
        os.close(fd)
    assert doc.text == "" and "symbolic link" in doc.error


def test_paths_named_by_the_caller_may_be_symlinks(tmp_path, outside):
    os.symlink(outside / "secret.txt", tmp_path / "named.txt")
    os.symlink(outside, tmp_path / "named-folder")
    os.symlink(outside / "secret.txt", outside / "inner-link")
    docs = by_name(load_documents([tmp_path / "named.txt", tmp_path / "named-folder"]))
    assert docs["named.txt"].text == SECRET  # the user named this link: it is read
    assert docs["secret.txt"].text == SECRET
    assert "symbolic link" in docs["inner-link"].error  # but links inside it are still skipped


def load_without_hanging(sources) -> list[Document]:
    """load_documents in a thread; if it blocks on a FIFO, a writer unblocks it and the test fails."""
    loaded: list[list[Document]] = []
    reader = threading.Thread(target=lambda: loaded.append(load_documents(sources)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        for fifo in Path(sources[0]).parent.rglob("pipe"):
            with open(fifo, "w"):
                pass
        reader.join(10)
        pytest.fail("load_documents blocked on a FIFO")
    return loaded[0]


def test_fifos_are_reported_without_blocking(tmp_path):
    write(tmp_path / "docs" / "a.txt", "alpha")
    os.mkfifo(tmp_path / "docs" / "pipe")
    docs = by_name(load_without_hanging([tmp_path / "docs"]))
    assert "not a regular file" in docs["pipe"].error and docs["a.txt"].text == "alpha"
    [named] = load_without_hanging([tmp_path / "docs" / "pipe"])
    assert "not a regular file" in named.error


# ---------------------------------------------------------------- defect 2: symlinks in the output folder


def test_an_existing_symlink_at_an_output_path_is_replaced_not_written_through(tmp_path):
    bashrc = write(tmp_path / "home" / ".bashrc", "export PATH=/usr/bin\n")
    out = tmp_path / "out"
    out.mkdir()
    doc = Document("doc.txt", "text")
    os.symlink(bashrc, summary_path(out, doc))
    os.symlink(bashrc, record_path(out, doc))
    write_outputs(out, doc, "the summary", RECORD)
    assert bashrc.read_text() == "export PATH=/usr/bin\n"
    for path in (summary_path(out, doc), record_path(out, doc)):
        assert stat.S_ISREG(os.lstat(path).st_mode), path
    assert summary_path(out, doc).read_text() == "the summary\n"
    assert json.loads(record_path(out, doc).read_text()) == RECORD
    assert outputs_under(out) == ["doc.txt.summary.json", "doc.txt.summary.txt"]  # no temporary left


def test_a_symlinked_folder_inside_the_output_folder_is_refused(tmp_path, outside):
    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    os.symlink(outside, out / "away")  # resolves outside out/
    os.symlink(out / "real", out / "inside")  # resolves inside out/, still a link
    for name in ("away/x.txt", "inside/x.txt"):
        with pytest.raises(UnsafeOutputPath):
            write_outputs(out, Document(name, "text"), "the summary", RECORD)
    assert outputs_under(outside) == ["secret.txt"] and outputs_under(out / "real") == []


def test_the_output_folder_itself_may_be_a_symlink(tmp_path):
    (tmp_path / "real-out").mkdir()
    os.symlink(tmp_path / "real-out", tmp_path / "out")
    write_outputs(tmp_path / "out", Document("a/b.txt", "text"), "the summary", RECORD)
    assert outputs_under(tmp_path / "real-out") == ["a/b.txt.summary.json", "a/b.txt.summary.txt"]


# ---------------------------------------------------------------- defect 3: names escaping the output folder


@pytest.mark.parametrize(
    "name, safe",
    [
        ("../../x", "__/__/x"),
        ("/etc/passwd", "etc/passwd"),
        (".bashrc", "_bashrc"),
        ("a/./b//c/", "a/b/c"),
        ("..", "__"),
        ("...hidden", "___hidden"),
        ("bad\x00name\n\x1b[31m\u202e", "bad_name__[31m_"),
        ("", "unnamed"),
        ("/./", "unnamed"),
        ("a/b.txt", "a/b.txt"),
        ("résumé v2.txt", "résumé v2.txt"),
    ],
)
def test_document_names_become_safe_relative_paths(name, safe):
    assert safe_name(name) == safe


def test_unsafe_names_from_the_api_are_sanitized_and_stay_inside_the_output_folder(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    names = ["../../x", "/etc/passwd", ".bashrc", "..", "x", "bad\nname"]
    docs = load_documents([Document(name, "text") for name in names])
    assert [d.name for d in docs] == ["__/__/x", "etc/passwd", "_bashrc", "__", "x", "bad_name"]
    for doc in docs:
        write_outputs(out, doc, "the summary", RECORD)
        assert summary_path(out, doc).resolve().is_relative_to(out.resolve())
    assert len(outputs_under(out)) == 2 * len(names)
    assert outputs_under(tmp_path) == sorted(f"a/b/out/{p}" for p in outputs_under(out))


def test_write_outputs_refuses_an_unsafe_name_given_to_it_directly(tmp_path):
    out = tmp_path / "out"
    for name in ("../escape", "/tmp/escape", "a/../../escape", ".hidden"):
        with pytest.raises(UnsafeOutputPath, match="unsafe document name"):
            write_outputs(out, Document(name, "text"), "the summary", RECORD)
    assert outputs_under(tmp_path) == []


def test_names_from_paths_are_sanitized_and_unique(tmp_path):
    write(tmp_path / ".notes", "dotted")
    write(tmp_path / "line\nbreak.txt", "odd")
    write(tmp_path / "docs" / "line\nbreak.txt", "odd too")
    docs = load_documents([tmp_path / ".notes", tmp_path / "line\nbreak.txt", tmp_path / "docs"])
    assert [d.name for d in docs] == ["_notes", "line_break.txt", "line_break.txt-2"]


# ---------------------------------------------------------------- normal folders


def test_a_nested_folder_maps_to_nested_outputs(tmp_path):
    write(tmp_path / "docs" / "a.txt", "alpha")
    write(tmp_path / "docs" / "sub" / "b.txt", "beta")
    write(tmp_path / "docs" / "sub" / "deeper" / "c.txt", "gamma")
    write(tmp_path / "docs" / "z.txt", "zeta")
    write(tmp_path / "docs" / ".git" / "config", "hidden folder: skipped")
    write(tmp_path / "docs" / "sub" / ".hidden", "hidden file: skipped")
    docs = load_documents(tmp_path / "docs")
    assert [(d.name, d.text) for d in docs] == [
        ("a.txt", "alpha"),
        ("sub/b.txt", "beta"),
        ("sub/deeper/c.txt", "gamma"),
        ("z.txt", "zeta"),
    ]
    assert docs[1].source == str(tmp_path / "docs" / "sub" / "b.txt")
    out = tmp_path / "out"
    for doc in docs:
        write_outputs(out, doc, f"summary of {doc.text}", {"document": doc.name})
    assert outputs_under(out) == sorted(f"{d.name}.summary.{ext}" for d in docs for ext in ("txt", "json"))
    assert (out / "sub" / "deeper" / "c.txt.summary.txt").read_text() == "summary of gamma\n"
    assert json.loads((out / "sub" / "b.txt.summary.json").read_text()) == {"document": "sub/b.txt"}


def test_an_unreadable_subfolder_is_reported(tmp_path):
    write(tmp_path / "docs" / "locked" / "a.txt", "alpha")
    (tmp_path / "docs" / "locked").chmod(0)
    try:
        if os.access(tmp_path / "docs" / "locked", os.R_OK):
            pytest.skip("running as root: permissions are not enforced")
        [doc] = load_documents(tmp_path / "docs")
    finally:
        (tmp_path / "docs" / "locked").chmod(0o755)
    assert doc.name == "locked" and "cannot read folder" in doc.error


# ---------------------------------------------------------------- through the pipeline (Redis, no model jobs)


@pytest.fixture(scope="module")
def published_info():
    from transformers import AutoTokenizer

    from conveyor.clients.model_info import ModelInfo
    from conveyor.engine.models.loader import resolve_model_dir

    return ModelInfo.from_hf_tokenizer(
        "smollm2", 8192, {2}, AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    )


def test_the_cli_reports_skipped_links_and_unwritable_outputs_per_document(
    tmp_path, outside, redis_url, namespace, published_info, capsys
):
    """Only documents that need no job (skipped, empty), so no replica: each problem stays
    that document's error, and the other documents' records are still written."""
    import redis

    from conveyor.clients.keys import Keys
    from conveyor.clients.model_info import publish_model_info

    conn = redis.Redis.from_url(redis_url)
    publish_model_info(conn, Keys(namespace), published_info)
    conn.close()
    write(tmp_path / "docs" / "blocked" / "empty.txt", "")
    write(tmp_path / "docs" / "fine.txt", "")
    os.symlink(outside / "secret.txt", tmp_path / "docs" / "link.txt")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "blocked")
    # --job-timeout: a regression that reads the linked secret submits a job no replica answers.
    args = [
        "summarize",
        str(tmp_path / "docs"),
        "--out",
        str(out),
        "--quiet",
        "--redis-url",
        redis_url,
        "--namespace",
        namespace,
        "--job-timeout",
        "5",
    ]
    assert conveyor_cli.main(args) == cli.EXIT_JOB_FAILED
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)
    blocked, fine, link = errors
    assert "blocked/empty.txt: document is empty" in blocked and "cannot be written" in blocked
    assert "fine.txt: document is empty" in fine and "link.txt" in link and "symbolic link" in link
    assert outputs_under(outside) == ["secret.txt"]
    assert outputs_under(out) == ["fine.txt.summary.json", "index.html", "link.txt.summary.json"]  # + the report
    assert "symbolic link" in json.loads((out / "link.txt.summary.json").read_text())["error"]
