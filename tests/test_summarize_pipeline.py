"""Documents through a real SmolLM2 replica and Valkey: a PDF and an HTML page Debian ships
summarized with citations (record, reduce tree, index.html), a --schema run whose final JSON
validates, and --watch picking up files, resuming after kill -9 without resubmitting a
finished chunk, and finishing in flight on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import redis
from replica_harness import ReplicaThread
from scratch import scratch_namespace
from summarize_docs import pdf_document

from conveyor.apps.documents.summarize import summarize_documents
from conveyor.clients.keys import Keys
from conveyor.clients.model_info import ModelInfo, publish_model_info

REPO_ROOT = Path(__file__).resolve().parents[1]
JSON_C_README = Path("/usr/share/doc/libjson-c5/README.html")
# Small budgets: a page per chunk of the PDF, several chunks of the page, two levels of reduce.
OPTIONS = dict(max_tokens=24, context_tokens=256, max_chunk_tokens=60)
CLI_OPTIONS = ["--max-tokens", "24", "--context-tokens", "256", "--max-chunk-tokens", "60"]
# Strings bounded so that any JSON under it fits SCHEMA_TOKENS (a token is at least a character).
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 1, "maxItems": 2},
    },
    "required": ["topic", "facts"],
    "additionalProperties": False,
}
SCHEMA_TOKENS = 128


@pytest.fixture(scope="module")
def replica(redis_url):
    """One SmolLM2 replica on one torch thread for the whole module, its model info published."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            scratch_namespace(redis_url) as ns,
            # float32: batch-invariant tokens (test_summarize.REPLICA_OPTIONS says why)
            ReplicaThread(
                "smollm2", redis_url, ns, max_num_seqs=8, max_num_batched_tokens=512, dtype="float32"
            ) as running,
        ):
            engine = running.engine
            info = ModelInfo.from_hf_tokenizer(
                engine.spec.name, engine.max_model_len, engine.spec.eos_token_ids, engine.tokenizer
            )
            conn = redis.Redis.from_url(redis_url)
            publish_model_info(conn, Keys(ns), info)
            yield {"ns": ns, "conn": conn, "keys": Keys(ns)}
            conn.close()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cited(replica, redis_url, tmp_path_factory):
    inbox, out = tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("out")
    (inbox / "report.pdf").write_bytes(pdf_document())
    (inbox / "json-c.html").write_bytes(JSON_C_README.read_bytes())
    results = summarize_documents(
        [inbox / "report.pdf", inbox / "json-c.html"], out, redis_url=redis_url, namespace=replica["ns"], **OPTIONS
    )
    return {r.name: r for r in results}, out


@pytest.mark.slow
def test_a_pdf_and_an_html_page_are_summarized_with_citations(cited):
    results, out = cited
    pdf, html = results["report.pdf"], results["json-c.html"]
    assert pdf.ok and html.ok, (pdf.error, html.error)
    for chunk in pdf.record["chunks"]:  # each chunk's pages hold its text
        first, last = chunk["pages"]
        assert chunk["cite"] == (f"p. {first}" if first == last else f"p. {first}-{last}")
        assert chunk["summary"] and chunk["tokens"] <= 60
    assert {c["cite"] for c in pdf.record["chunks"]} == {"p. 1", "p. 2", "p. 3"}
    assert any(c["cite"].startswith("§ ") for c in html.record["chunks"])
    for result in (pdf, html):
        record, lines = result.record, result.summary.splitlines()
        assert lines and all(re.fullmatch(r"- .+ \[.+\]", line) for line in lines), lines
        assert len(record["points"]) == len(lines)
        for point, line in zip(record["points"], lines):
            assert point["chunks"] and all(0 <= i < len(record["chunks"]) for i in point["chunks"])
            assert line.endswith(f"[{point['cite']}]")
        top = [node for node in record["tree"] if node["level"] == record["levels"] - 1]
        assert len(top) == 1 and top[0]["chunks"] == list(range(len(record["chunks"])))
    report = (out / "index.html").read_text()
    assert "report.pdf" in report and "json-c.html" in report and "href='#d0-c0'" in report
    assert "<script" not in report


@pytest.mark.slow
def test_schema_makes_every_step_json_and_the_final_json_validates(replica, redis_url, tmp_path):
    (tmp_path / "notes.md").write_text(
        "# Queues\n\nProducers put jobs on a stream.\n\n# Cache\n\n"
        "The cache is a pool of fixed blocks shared by sequences.\n"
    )
    [result] = summarize_documents(
        [tmp_path / "notes.md"],
        tmp_path / "out",
        redis_url=redis_url,
        namespace=replica["ns"],
        max_tokens=SCHEMA_TOKENS,
        context_tokens=512,
        max_chunk_tokens=16,
        schema=SCHEMA,
    )
    assert result.ok, result.error
    jsonschema.validate(result.record["summary_json"], SCHEMA)
    assert json.loads(result.summary) == result.record["summary_json"]
    steps = [c["summary"] for c in result.record["chunks"]] + [t["summary"] for t in result.record["tree"]]
    assert len(steps) >= 3
    for step in steps:
        jsonschema.validate(json.loads(step), SCHEMA)


def entries_added(conn, stream: str) -> int:
    return conn.xinfo_stream(stream)["entries-added"] if conn.exists(stream) else 0


def start_watch(redis_url: str, ns: str, inbox: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor",
            "summarize",
            "--watch",
            str(inbox),
            "--out",
            str(out),
            "--poll-s",
            "0.2",
            "--redis-url",
            redis_url,
            "--namespace",
            ns,
            "--max-in-flight",
            "2",
            *CLI_OPTIONS,
        ],
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(condition, process: subprocess.Popen, timeout: float = 240.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the watcher exited ({process.returncode}): {process.stderr.read()}"
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_watch_picks_up_files_and_resumes_after_kill_9_without_resubmitting(replica, redis_url, tmp_path, cited):
    conn, keys = replica["conn"], replica["keys"]
    expected = cited[0]["report.pdf"]
    job_ids = {j["job_id"] for j in expected.record["jobs"]}
    for job in job_ids:  # the module's earlier run made these; this test makes them again
        conn.delete(keys.job(job), keys.out(job))
    before = entries_added(conn, keys.batch)
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    inbox.mkdir()
    watcher = start_watch(redis_url, replica["ns"], inbox, out)
    (inbox / "report.pdf").write_bytes(pdf_document())

    def jobs_done() -> int:
        return sum(conn.hget(keys.job(j), "status") == b"done" for j in job_ids)

    wait_until(lambda: jobs_done() >= 1, watcher, what="a first chunk summarized")
    watcher.send_signal(signal.SIGKILL)
    watcher.wait(10)
    submitted_before = {j for j in job_ids if conn.exists(keys.job(j))}
    assert len(submitted_before) < len(job_ids), "kill came too late"

    watcher = start_watch(redis_url, replica["ns"], inbox, out)
    summary = out / "report.pdf.summary.txt"
    wait_until(summary.exists, watcher, what="the summary after the restart")
    assert summary.read_text() == expected.summary + "\n"
    assert entries_added(conn, keys.batch) - before == len(job_ids)  # every job enqueued once, across the kill

    (inbox / "notes.txt").write_text("Replicas batch decoding steps. Finished sequences leave the batch.\n")
    wait_until(
        lambda: conn.exists(keys.batch) and entries_added(conn, keys.batch) > before + len(job_ids),
        watcher,
        what="the new file's first job",
    )
    watcher.send_signal(signal.SIGTERM)  # in flight: it finishes before the watcher exits
    assert watcher.wait(240) == 0
    assert (out / "notes.txt.summary.txt").exists()
    state = json.loads((out / ".conveyor-watch.json").read_text())
    assert set(state) == {"report.pdf", "notes.txt"}
    report = (out / "index.html").read_text()
    assert "report.pdf" in report and "notes.txt" in report
