"""Issue 39 hardening of `conveyor summarize` (apps/documents/), each against real components:

- items 2 and 3: every step that reads a hostile document's bytes in the summarizer's own
  process (format sniffing, Markdown/reST headings, paragraphs, chunk boundaries, chunk
  coordinates) runs in linear time. The classic pathological inputs (`<!---->` x 40 then
  `x`, a 200 KB ATX heading line, ...) run in a child process under RLIMIT_AS, RLIMIT_CPU
  and a wall timeout, each timed against a benign input of the same size;
- item 4: `--watch` never reads through a folder swapped for a symlink between its listing
  and its read (nor does the batch walk);
- item 10b: names are printed escaped in every line of summarize and --watch;
- item 14: a job that answers nothing makes its document an error naming the job id, the
  command exits non-zero, no reduce runs over empty summaries, and a rerun submits nothing.

Real Valkey (conftest's redis_url), real files and symlinks in tmp_path, SmolLM2's real
tokenizer for the model info, and a real replica of the tiny random Llama for item 14.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from conveyor import cli as conveyor_cli
from conveyor.apps.documents import cli as summarize_cli
from conveyor.apps.documents import documents, summarize_watch
from conveyor.apps.documents.documents import load_documents
from conveyor.apps.documents.summarize_watch import watch_folder_async
from conveyor.clients import AsyncClient, cli
from conveyor.clients.keys import Keys
from conveyor.clients.model_info import ModelInfo, publish_model_info

SECRET = "TOP SECRET: must never reach the model"
EVIL = "evil\x1b]0;pwned\x07\x1b[31m\nerror: forged line"  # retitles, recolours, forges a line


@pytest.fixture(scope="module")
def smollm2_info():
    """SmolLM2's real tokenizer as a replica publishes it (no model loaded)."""
    from transformers import AutoTokenizer

    from conveyor.engine.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    return ModelInfo.from_hf_tokenizer("smollm2", 8192, {2}, tokenizer)


@pytest.fixture
def published(redis_url, namespace, smollm2_info):
    conn = redis.Redis.from_url(redis_url)
    publish_model_info(conn, Keys(namespace), smollm2_info, ttl_s=300)
    conn.close()
    return namespace


def requests_added(redis_url: str, ns: str) -> int:
    """Jobs ever added to the namespace's request streams (both priority classes)."""
    conn = redis.Redis.from_url(redis_url)
    try:
        keys = Keys(ns)
        streams = [keys.requests(c) for c in ("batch", "interactive")]
        return sum(conn.xinfo_stream(s)["entries-added"] for s in streams if conn.exists(s))
    finally:
        conn.close()


def all_request_payloads(redis_url: str, ns: str) -> bytes:
    conn = redis.Redis.from_url(redis_url)
    try:
        found = b""
        for key in conn.scan_iter(match=f"{ns}:*"):
            if conn.type(key) == b"stream":
                found += b"".join(repr(fields).encode() for _, fields in conn.xrange(key))
        return found
    finally:
        conn.close()


# ---------------------------------------------------------------- items 2 and 3: linear time

# Run in a child process under limits: each case's hostile bytes, then benign bytes of the
# same size through the same steps; prints {case: [hostile_s, benign_s, format]}.
TIMING_CHILD = textwrap.dedent(
    r"""
    import codecs, json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (40, 41))
    from conveyor.apps.documents import doc_layout
    from conveyor.apps.documents.chunking import Boundaries
    from conveyor.apps.documents.doc_layout import section_starts
    from conveyor.apps.documents.documents import document_from_bytes

    def steps(data, name):
        doc = document_from_bytes(data, name)
        assert doc.error is None, doc.error
        Boundaries(doc.text, [], section_starts(doc.text, doc.spans))
        return doc

    def located(data, name):
        # the pipeline's record of a chunk's coordinates (summarize._Record.add_chunks), for
        # chunks every 1,000 characters: Locator where it exists, else a call per chunk
        doc = steps(data, name)
        locator = getattr(doc_layout, "Locator", None)
        where = locator(doc.text, doc.spans).coordinates if locator else (
            lambda s, e: doc_layout.coordinates(doc.text, doc.spans, s, e))
        for start in range(0, len(doc.text), 1000):
            where(start, min(start + 1000, len(doc.text)))
        return doc

    def timed(run, data, name):
        started = time.perf_counter()
        doc = run(data, name)
        return time.perf_counter() - started, doc.format

    def words(size):
        return (b"plain words " * (size // 12 + 1))[:size]

    utf16 = codecs.BOM_UTF16_LE + ("<!---->" * 40 + "x").encode("utf-16-le")
    cases = {
        "html comments x40 (281 bytes)": (steps, b"<!---->" * 40 + b"x", "a.txt"),
        "html comments filling the sniff window": (steps, b"<!---->" * 585 + b"x", "a.txt"),
        "html comments x40, UTF-16": (steps, utf16, "a.txt"),
        "unclosed comments": (steps, b"<!--" * 1024, "a.txt"),
        "unclosed tags": (steps, b"<p" * 2048, "a.txt"),
        "200 KB ATX heading line": (steps, b"# x" + b" #" * 100_000 + b"y", "a.md"),
        "200 KB ATX heading, sniffed": (steps, b"# x" + b" #" * 100_000 + b"y", "a.txt"),
        "1 MB setext underline": (steps, b"x\n" + b"=" * 1_000_000 + b"y", "a.md"),
        "1 MB reST adornment": (steps, b"x\n" + b"=" * 1_000_000 + b"y", "a.rst"),
        "1 MB of '#'": (steps, b"#" * 1_000_000, "a.md"),
        "1 MB of fences": (steps, b"`" * 1_000_000, "a.md"),
        "1 MB whitespace run": (steps, b"\n" + b" \t" * 500_000 + b"x", "a.txt"),
        "blank lines of spaces": (steps, b"\n " * 500_000 + b"x", "a.md"),
        "1 MB, 200,000 paragraphs": (located, b"ab.\n\n" * 200_000, "a.txt"),
    }
    results = {}
    for label, (run, data, name) in cases.items():
        benign = words(len(data)) if not data.startswith(codecs.BOM_UTF16_LE) else (
            codecs.BOM_UTF16_LE + words(len(data) // 2 - 1).decode().encode("utf-16-le"))
        hostile_s, kind = timed(run, data, name)
        benign_s, _ = timed(run, benign, name)
        results[label] = [hostile_s, benign_s, kind]
        print(json.dumps({label: results[label]}), file=sys.stderr, flush=True)
    print(json.dumps(results))
    """
)


def test_hostile_documents_cost_linear_time_in_the_summarizers_process():
    """Items 2 and 3: the old HTML sniff took exponential time (`<!---->` x 24: 3 s, x 40: never
    ends), the old ATX heading quadratic (40 KB: 5.8 s, 100 KB: 26 s, 200 KB: over a minute), the old
    coordinates quadratic in paragraphs x chunks (200,000 paragraphs: 4.3 s). Each case must
    now cost no more than a benign input of its size, within a generous factor."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", TIMING_CHILD], capture_output=True, text=True, timeout=90, check=False
        )
    except subprocess.TimeoutExpired as exc:
        partial = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"the hostile documents took over 90 s; finished before the stop: {partial}")
    stopped = " (SIGXCPU: past the child's 40 s CPU limit)" if done.returncode == -signal.SIGXCPU else ""
    assert done.returncode == 0, f"the child ended with {done.returncode}{stopped}; timed before: {done.stderr[-2000:]}"
    results = json.loads(done.stdout)
    slow = {
        label: f"{hostile:.3f} s (benign input of that size: {benign:.3f} s)"
        for label, (hostile, benign, _) in results.items()
        if hostile > 1.0 + 50 * benign
    }
    assert not slow, slow
    assert {kind for _, _, kind in results.values()} <= {"text", "markdown", "rst"}  # none went to the worker


def test_html_is_still_told_by_its_start_or_its_tags():
    from conveyor.apps.documents.doc_formats import detect_format

    html = [
        b"<!DOCTYPE html><p>x",
        b"  <!-- a --> <!-- b -->\n<HTML lang=en>",
        b"\xef\xbb\xbf<body>",
        b"<!---->" * 3 + b"<head>",
        "\ufeff<!-- c --><html>".encode("utf-16"),
        b"text <div>a</div> <p>b</p> <h2 id=x>c</h2>",
    ]
    text = [  # (the hostile sizes run in a limited child: test_hostile_documents_cost_linear_time...)
        b"<!---->" * 3 + b"x",
        b"<!-- never closed <html>",
        b"<htmlx>",
        b"<!doctypehtml>",
        b"<div> <p> <pre>",
        b"<div>a</div> <title",
    ]
    assert [detect_format(data) for data in html] == ["html"] * len(html)
    assert [detect_format(data) for data in text] == ["text"] * len(text)


def test_atx_headings_keep_their_titles():
    from conveyor.apps.documents.extract_markup import markdown_blocks

    blocks = markdown_blocks("# Title #\n\n  ## C# and F# ##  \n\ntext\n\n####### seven\n\n#no space\n\n#\t \n")
    assert [(b.text, b.level) for b in blocks] == [
        ("Title", 1),
        ("C# and F", 2),
        ("text", 0),
        ("####### seven", 0),
        ("#no space", 0),
        ("", 1),
    ]


# ---------------------------------------------------------------- item 4: symlinks swapped in


@pytest.fixture
def swap_tree(tmp_path):
    """inbox/sub/secret.txt (harmless text) and outside/secret.txt (the secret)."""
    (tmp_path / "inbox" / "sub").mkdir(parents=True)
    (tmp_path / "inbox" / "sub" / "secret.txt").write_text("A harmless note inside the inbox.")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text(SECRET)
    return tmp_path


def swap_for_symlink(tree: Path) -> None:
    """Replace inbox/sub by a symlink to the outside folder (the original moves aside)."""
    os.rename(tree / "inbox" / "sub", tree / "sub-moved")
    os.symlink(tree / "outside", tree / "inbox" / "sub")


async def watch_until(inbox: Path, out: Path, redis_url: str, ns: str, done, timeout: float = 30.0, **options) -> str:
    """Run watch_folder_async until `done(progress text)` or `timeout`; its progress lines."""
    stop, progress = asyncio.Event(), io.StringIO()
    async with AsyncClient(redis_url, ns) as client:
        task = asyncio.create_task(
            watch_folder_async(
                inbox, out, client=client, stop=stop, poll_s=0.05, wait_s=10, progress=progress, **options
            )
        )
        deadline = time.monotonic() + timeout
        while not done(progress.getvalue()) and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, timeout)
    return progress.getvalue()


def test_watch_never_reads_through_a_folder_swapped_for_a_symlink(
    swap_tree, redis_url, published, monkeypatch, tmp_path
):
    """Item 4: the old watcher read inbox/sub/secret.txt by path once it was listed; with sub
    swapped for a symlink between the listing and the read, it summarized the outside file."""
    read: list[bytes] = []
    real_ready, real_from_bytes = summarize_watch._Watcher._ready_files, summarize_watch.document_from_bytes

    def ready_then_swap(self):
        ready = real_ready(self)
        if any(name == "sub/secret.txt" for name, _ in ready):
            swap_for_symlink(swap_tree)  # after the listing, before the read
        return ready

    def reading(data, *args, **kwargs):
        read.append(data)
        return real_from_bytes(data, *args, **kwargs)

    monkeypatch.setattr(summarize_watch._Watcher, "_ready_files", ready_then_swap)
    monkeypatch.setattr(summarize_watch, "document_from_bytes", reading)
    lines = asyncio.run(
        watch_until(
            swap_tree / "inbox",
            tmp_path / "out",
            redis_url,
            published,
            lambda text: "sub/secret.txt" in text and "error" in text,
            job_timeout=2.0,
        )
    )
    assert all(SECRET.encode() not in data for data in read), "the outside file was read"
    assert SECRET.encode() not in all_request_payloads(redis_url, published)
    assert requests_added(redis_url, published) == 0, lines
    [error] = [line for line in lines.splitlines() if "sub/secret.txt" in line]
    assert error.startswith("error: skipped ") and "symbolic link" in error, lines


def test_the_batch_walk_never_reads_through_a_folder_swapped_for_a_symlink(swap_tree, monkeypatch):
    """Item 4, batch: the walk enters folders by descriptor with O_NOFOLLOW (no gap to close)."""
    real = documents._walk_subfolder

    def swap_then_enter(parent_fd, entry, *args, **kwargs):
        if entry == "sub":
            swap_for_symlink(swap_tree)  # after the folder was scanned, before it is entered
        return real(parent_fd, entry, *args, **kwargs)

    monkeypatch.setattr(documents, "_walk_subfolder", swap_then_enter)
    docs = load_documents(swap_tree / "inbox")
    assert [d.name for d in docs] == ["sub"] and "symbolic link" in docs[0].error
    assert all(SECRET not in d.text for d in docs)


def test_read_inside_checks_what_it_opened_not_the_path(swap_tree):
    from conveyor.apps.documents.documents import SkippedFile, read_inside

    inbox = swap_tree / "inbox"
    assert read_inside(inbox, "sub/secret.txt") == b"A harmless note inside the inbox."
    os.symlink(swap_tree / "outside" / "secret.txt", inbox / "link.txt")
    os.mkfifo(inbox / "fifo")  # opening must not hang, and it is not a regular file
    for name in ("link.txt", "fifo"):
        with pytest.raises(SkippedFile):
            read_inside(inbox, name)
    swap_for_symlink(swap_tree)
    with pytest.raises(SkippedFile, match="symbolic link"):
        read_inside(inbox, "sub/secret.txt")
    for name in ("../outside/secret.txt", "/etc/passwd", "sub//secret.txt"):
        with pytest.raises(ValueError):
            read_inside(inbox, name)
    assert documents.list_files(inbox) == []  # a symlink, a FIFO and a symlinked folder: nothing listed


# ---------------------------------------------------------------- item 10b: names printed escaped


def assert_escaped(output: str, lines_start: str) -> None:
    assert "\x1b" not in output and "\x07" not in output, output
    assert "\\x1b]0;pwned\\x07\\x1b[31m\\nerror: forged line" in output, output
    assert all(line.startswith(lines_start) for line in output.splitlines() if line), output


def test_summarize_prints_file_names_escaped(tmp_path, redis_url, published, capsys):
    """Item 10b: the old lines carried raw names: ESC sequences and a forged line."""
    folder = tmp_path / "docs"
    folder.mkdir()
    os.symlink(tmp_path / "nowhere", folder / f"{EVIL}.link")  # error line: skipped PATH: a symlink
    (folder / f"{EVIL}.bin").write_bytes(b"\x00\x01\x02" * 50)  # error line: PATH is binary data
    code = conveyor_cli.main(
        ["summarize", str(folder), "--out", str(tmp_path / "out"), "--quiet", "--redis-url", redis_url]
        + ["--namespace", published, "--wait-s", "5"]
    )
    out, err = capsys.readouterr()
    assert code == cli.EXIT_JOB_FAILED and not out
    assert len(err.splitlines()) == 2, err  # one line per document, none forged
    assert_escaped(err, "error: ")


def test_watch_prints_file_names_escaped(tmp_path, redis_url, published):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / f"{EVIL}.bin").write_bytes(b"\x00\x01\x02" * 50)
    lines = asyncio.run(
        watch_until(inbox, tmp_path / "out", redis_url, published, lambda text: "binary" in text, timeout=20)
    )
    errors = [line for line in lines.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is binary data" in errors[0], lines
    assert_escaped(lines, ("error: ", "watch ", "stopping"))


# ---------------------------------------------------------------- item 14: empty answers fail, reruns reuse


NOTES = " ".join(
    f"Paragraph {n} says that queues keep jobs safe while replicas restart and batch their steps." for n in range(12)
)
# A small context and chunk cap: the notes make several chunks, so a reduce would follow the maps.
TINY_OPTIONS = ["--max-tokens", "8", "--context-tokens", "256", "--max-chunk-tokens", "40"]


@pytest.fixture(scope="module")
def tiny_replica(redis_url, tiny_model):
    """A real replica of the tiny random Llama (768 tokens); it publishes its model info."""
    import torch
    from replica_harness import ReplicaThread
    from scratch import scratch_namespace

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with scratch_namespace(redis_url) as ns, ReplicaThread(tiny_model, redis_url, ns, max_num_seqs=8) as running:
            yield {"ns": ns, "vocab": len(running.engine.tokenizer)}
    finally:
        torch.set_num_threads(threads)


def test_a_job_that_answers_nothing_fails_its_document_naming_the_job(tiny_replica, redis_url, tmp_path, monkeypatch):
    """Item 14: every token a stop token, so each job finishes `done` with no text. The old
    pipeline went on to reduce the empty chunk summaries (one more job: a model that answered
    it made up the summary of nothing, and the run exited 0), and where that answer was empty
    too it said only 'the model returned an empty summary', naming no job."""
    ns = tiny_replica["ns"]
    every_token = list(range(tiny_replica["vocab"]))
    # `conveyor summarize` has no flag for job options: the real function, given one more option
    real = summarize_cli.summarize_documents_async
    monkeypatch.setattr(
        summarize_cli, "summarize_documents_async", functools.partial(real, job_options={"stop_token_ids": every_token})
    )
    (tmp_path / "notes.txt").write_text(NOTES)
    out = tmp_path / "out"
    command = ["summarize", str(tmp_path / "notes.txt"), "--out", str(out), "--quiet", *TINY_OPTIONS]
    command += ["--redis-url", redis_url, "--namespace", ns, "--wait-s", "10", "--job-timeout", "60"]

    first, err = run_cli(command)
    err = error_lines(err)
    record = json.loads((out / "notes.txt.summary.json").read_text())
    maps = [job for job in record["jobs"] if job["kind"] == "map"]
    assert first == cli.EXIT_JOB_FAILED and len(maps) >= 2, err
    assert record["status"] == "error" and record["summary"] is None and not (out / "notes.txt.summary.txt").exists()
    assert [job["kind"] for job in record["jobs"]] == ["map"] * len(maps)  # no reduce over nothing
    assert requests_added(redis_url, ns) == len(maps)
    assert err.startswith(f"error: notes.txt: map job 0 of level 0 ({maps[0]['job_id']}) returned an empty summary")

    again, err_again = run_cli(command)
    err_again = error_lines(err_again)
    rerun = json.loads((out / "notes.txt.summary.json").read_text())
    assert again == cli.EXIT_JOB_FAILED and err_again == err
    assert rerun["submitted"] == 0 and rerun["reused"] == len(maps)
    assert requests_added(redis_url, ns) == len(maps)  # the rerun submitted nothing


def error_lines(err: str) -> str:
    return "\n".join(line for line in err.splitlines() if line.startswith("error: "))


def run_cli(command: list[str]) -> tuple[int, str]:
    """conveyor.cli.main in this process, its stderr captured (the replica runs on a thread)."""
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = conveyor_cli.main(command)
    return code, err.getvalue()
