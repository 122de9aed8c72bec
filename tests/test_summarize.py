"""Summarization pipeline: chunking on SmolLM2's real tokenizer, then map-reduce through a
real replica and Valkey (uninterrupted, rerun, killed midway and resumed)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from replica_harness import ReplicaThread
from scratch import scratch_namespace

from conveyor import cli as conveyor_cli
from conveyor.apps.documents.chunking import MIN_FILL
from conveyor.apps.documents.documents import Document, load_documents
from conveyor.apps.documents.summarize import summarize_documents, summarize_documents_async
from conveyor.apps.documents.summary_prompts import Prompts, SummarizeError, SummarizeOptions, job_id
from conveyor.clients import AsyncClient, cli
from conveyor.clients.keys import Keys
from conveyor.clients.model_info import ModelInfo, publish_model_info

REPO_ROOT = Path(__file__).resolve().parents[1]
LICENCE = Path("/usr/share/common-licenses/LGPL-3")
# Small budgets so a two-page text makes several chunks and the reduce runs on two levels.
OPTIONS = dict(max_tokens=24, context_tokens=256)
# float32: the resumed run must write the uninterrupted run's summaries, and its jobs run in other
# batches; dtype=auto's bf16 copy (CPUs with AVX512-BF16/AMX) makes a job's tokens depend on its batch
REPLICA_OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=512, dtype="float32")


@pytest.fixture(scope="module")
def info():
    from transformers import AutoTokenizer

    from conveyor.engine.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    return ModelInfo.from_hf_tokenizer("smollm2", 8192, {2}, tokenizer)


@pytest.fixture(scope="module")
def counter(info):
    return info.token_counter()


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Two real texts shipped on the machine: a licence and a stdlib module's docstring."""
    folder = tmp_path_factory.mktemp("texts")
    (folder / "argparse-doc.txt").write_text(inspect.getdoc(argparse))
    return [LICENCE, folder / "argparse-doc.txt"]


def prompts_for(counter, **options) -> Prompts:
    return Prompts(SummarizeOptions(**options), counter, 8192)


def squash(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- chunking, no server


def test_chunks_follow_the_token_budget_and_cover_the_text(counter):
    doc = Document("lgpl", LICENCE.read_text())
    chunks = prompts_for(counter, max_chunk_tokens=150).chunks(doc)
    sizes = [counter.count(c.text, add_special_tokens=False) for c in chunks]
    total = counter.count(doc.text, add_special_tokens=False)
    assert max(sizes) <= 150
    assert -(-total // 150) <= len(chunks) <= total // (150 * MIN_FILL) + 1
    assert squash(" ".join(c.text for c in chunks)) == squash(doc.text)  # in order, nothing lost
    at_sentence_end = sum(bool(re.search(r"[.!?:;)]$", c.text)) for c in chunks[:-1])
    assert at_sentence_end >= 0.8 * (len(chunks) - 1), [c.text[-30:] for c in chunks]


def test_prompts_fit_the_context_with_the_instruction_counted_exactly(counter):
    prompts = prompts_for(counter, max_tokens=24, context_tokens=200)
    prompt_sizes = [
        counter.count_chat(prompts.map_messages(c.text)) for c in prompts.chunks(Document("d", LICENCE.read_text()))
    ]
    assert max(prompt_sizes) + 24 <= 200
    assert sorted(prompt_sizes)[-2] + 24 >= 200 - 16  # the budget is used, not wasted


def test_overlap_repeats_the_end_of_each_chunk(counter):
    chunks = prompts_for(counter, max_chunk_tokens=120, overlap_tokens=30).chunks(Document("d", LICENCE.read_text()))
    for before, after in zip(chunks, chunks[1:]):
        assert after.start < before.end and squash(after.text[:40]) in squash(before.text)


def test_map_prompts_share_the_instruction_as_a_token_prefix(counter):
    prompts = prompts_for(counter)
    first, second = (counter.encode_chat(prompts.map_messages(t)) for t in ("Queues are fine.", "Another text."))
    instruction_end = prompts.options.map_instruction
    rendered = counter.render_chat(prompts.map_messages("Queues are fine."))
    shared = counter.encode(rendered[: rendered.index(instruction_end) + len(instruction_end)], False)
    assert first[: len(shared)] == second[: len(shared)] == shared


def test_job_ids_derive_from_content_step_parameters_and_model():
    doc, messages, options = Document("a", "text"), [{"role": "user", "content": "x"}], SummarizeOptions()
    base = job_id("map", doc, 0, 1, messages, options, "smollm2")
    assert base == job_id(
        "map",
        Document("renamed", "text"),
        0,
        1,
        messages,
        options.model_copy(update={"max_in_flight": 2, "priority_class": "interactive"}),
        "smollm2",
    )
    changed = [
        job_id("map", Document("a", "other"), 0, 1, messages, options, "smollm2"),
        job_id("map", doc, 0, 2, messages, options, "smollm2"),
        job_id("map", doc, 0, 1, [{"role": "user", "content": "y"}], options, "smollm2"),
        job_id("map", doc, 0, 1, messages, SummarizeOptions(max_tokens=5), "smollm2"),
        job_id("map", doc, 0, 1, messages, options, "other-model"),
    ]
    assert len({base, *changed}) == 6 and re.fullmatch(r"sum-map-[0-9a-f]{40}", base)


def test_reduce_refuses_a_context_too_small_for_two_summaries(counter):
    prompts = prompts_for(counter, max_tokens=60, context_tokens=160)
    with pytest.raises(SummarizeError, match="two summaries"):
        prompts.groups(["word " * 55, "word " * 55])


def test_documents_from_files_and_folders(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("alpha")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("beta")
    (tmp_path / "docs" / ".hidden").write_text("skip me")
    (tmp_path / "a.txt").write_text("   \n")
    (tmp_path / "bin").write_bytes(b"\x89PNG\x00\xff\xfe")
    docs = load_documents([tmp_path / "docs", tmp_path / "a.txt", tmp_path / "bin", tmp_path / "missing"])
    assert [d.name for d in docs] == ["a.txt", "sub/b.txt", "a.txt-2", "bin", "missing"]
    problems = [d.problem() for d in docs]
    assert problems[:2] == [None, None] and "empty" in problems[2]
    assert "not UTF-8" in problems[3] and "cannot read" in problems[4]


def test_cli_reports_a_missing_model_and_bad_options(redis_url, namespace, tmp_path, capsys):
    base = ["summarize", str(LICENCE), "--out", str(tmp_path), "--redis-url", redis_url, "--namespace", namespace]
    assert conveyor_cli.main([*base, "--quiet", "--wait-s", "0"]) == cli.EXIT_JOB_FAILED
    assert "no model info published" in capsys.readouterr().err
    assert conveyor_cli.main([*base, "--quiet", "--wait-s", "0.6"]) == cli.EXIT_JOB_FAILED
    err = capsys.readouterr().err
    assert "within the wait limit of 0.6 s (wait_s, --wait-s)" in err and "waiting for" not in err  # --quiet
    assert conveyor_cli.main([*base, "--max-in-flight", "0"]) == cli.EXIT_USAGE  # checked before any wait
    assert "invalid option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        conveyor_cli.main([*base, "--wait-s", "-1"])
    assert "--wait-s: must be >= 0 seconds" in capsys.readouterr().err


def test_pipeline_waits_for_a_replica_to_publish_its_model(redis_url, namespace, tmp_path, capsys):
    """Started before any replica (as in compose): the run waits, then goes on with the model
    info published ~1 s later. That info has no tokenizer, so the run stops right after."""

    def publish_later():
        time.sleep(1.0)
        conn = redis.Redis.from_url(redis_url)
        publish_model_info(conn, Keys(namespace), ModelInfo("tiny", 256, (0,)), ttl_s=120)
        conn.close()

    publisher = threading.Thread(target=publish_later, daemon=True)
    publisher.start()
    started = time.monotonic()
    code = conveyor_cli.main(
        [
            "summarize",
            str(LICENCE),
            "--out",
            str(tmp_path),
            "--redis-url",
            redis_url,
            "--namespace",
            namespace,
            "--model",
            "tiny",
            "--wait-s",
            "30",
        ]
    )
    publisher.join(10)
    assert code == cli.EXIT_JOB_FAILED and 0.9 <= time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert f"waiting for a replica serving model 'tiny' in namespace {namespace!r} (0 s of 30 s)" in err
    assert "model 'tiny': its model info carries no tokenizer.json" in err  # got past the wait


# ---------------------------------------------------------------- through a real replica


fresh_namespace = scratch_namespace


@contextmanager
def smollm2_replica(redis_url: str, ns: str):
    """A SmolLM2 replica on one torch thread; publishes its model info as the replica will."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ReplicaThread("smollm2", redis_url, ns, **REPLICA_OPTIONS) as running:
            engine = running.engine
            info = ModelInfo.from_hf_tokenizer(
                engine.spec.name, engine.max_model_len, engine.spec.eos_token_ids, engine.tokenizer
            )
            conn = redis.Redis.from_url(redis_url)
            publish_model_info(conn, Keys(ns), info)
            conn.close()
            yield running
    finally:
        torch.set_num_threads(threads)


def entries_added(redis_url: str, stream: str) -> int:
    conn = redis.Redis.from_url(redis_url)
    try:
        return conn.xinfo_stream(stream)["entries-added"] if conn.exists(stream) else 0
    finally:
        conn.close()


@pytest.fixture(scope="module")
def uninterrupted(redis_url, texts, tmp_path_factory):
    """One full run over the real texts plus an empty, a binary and a missing document."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "empty.txt").write_text("")
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xd8")
    sources = [*texts, folder / "empty.txt", folder / "image.png", folder / "missing.txt"]
    out = tmp_path_factory.mktemp("out-a")
    with fresh_namespace(redis_url) as ns, smollm2_replica(redis_url, ns):
        started = time.perf_counter()
        results = summarize_documents(sources, out, redis_url=redis_url, namespace=ns, max_in_flight=8, **OPTIONS)
        seconds = time.perf_counter() - started
        added = {c: entries_added(redis_url, Keys(ns).requests(c)) for c in ("batch", "interactive")}
        yield {"ns": ns, "sources": sources, "out": out, "results": results, "seconds": seconds, "added": added}


def good(results):
    return [r for r in results if r.ok]


@pytest.mark.slow
def test_summarizes_real_texts_and_reports_bad_documents(uninterrupted, counter):
    results = uninterrupted["results"]
    assert [r.ok for r in results] == [True, True, False, False, False]
    empty, binary, missing = (r.error for r in results[2:])
    assert "empty.txt: document is empty" in empty
    assert "image.png" in binary and "not UTF-8" in binary
    assert "missing.txt" in missing and "cannot read" in missing
    for result in good(results):
        record = result.record
        total = counter.count(Path(result.source).read_text(), add_special_tokens=False)
        chunks = record["chunks"]
        assert len(chunks) >= 2 and max(c["prompt_tokens"] for c in chunks) + 24 <= 256
        budget = 256 - 24 - counter.count_chat(Prompts(SummarizeOptions(**OPTIONS), counter, 8192).map_messages(""))
        assert -(-total // budget) <= len(chunks) <= total // (budget * MIN_FILL) + 1
        maps = [j for j in record["jobs"] if j["kind"] == "map" and not j.get("retry")]  # retries: grounding
        assert len(maps) == len(chunks) and all(j["finish_reason"] in ("stop", "length") for j in record["jobs"])
        assert all(j["enqueued"] for j in record["jobs"]) and record["submitted"] == len(record["jobs"])
        assert result.summary.strip() and Path(record["summary_file"]).read_text().strip() == result.summary
        assert json.loads((uninterrupted["out"] / f"{result.name}.summary.json").read_text())["status"] == "done"
    assert results[0].record["levels"] >= 3  # licence: map, then two reduce levels
    jobs = sum(len(r.record["jobs"]) for r in results)
    assert uninterrupted["added"] == {"batch": jobs, "interactive": 0}  # batch priority, each job once


@pytest.mark.slow
def test_rerun_reuses_every_job_even_without_a_replica(uninterrupted, redis_url, capsys):
    async def rerun():
        async with AsyncClient(redis_url, uninterrupted["ns"]) as client:
            return await summarize_documents_async(uninterrupted["sources"][:2], client=client, **OPTIONS)

    again = asyncio.run(rerun())
    assert [r.summary for r in again] == [r.summary for r in uninterrupted["results"][:2]]
    assert all(r.record["submitted"] == 0 and r.record["reused"] == len(r.record["jobs"]) for r in again)
    args = [
        "summarize",
        *map(str, uninterrupted["sources"]),
        "--out",
        str(uninterrupted["out"]),
        "--quiet",
        "--redis-url",
        redis_url,
        "--namespace",
        uninterrupted["ns"],
        "--max-tokens",
        "24",
        "--context-tokens",
        "256",
    ]
    assert conveyor_cli.main(args) == cli.EXIT_JOB_FAILED  # the three bad documents
    out, err = capsys.readouterr()
    assert "LGPL-3: " in out and "0 submitted" in out and err.count("error: ") == 3


@pytest.mark.slow
def test_killed_pipeline_resumes_without_resubmitting(uninterrupted, redis_url, texts, tmp_path):
    expected = {r.name: r for r in good(uninterrupted["results"])}
    all_ids = {j["job_id"] for r in expected.values() for j in r.record["jobs"]}
    out = tmp_path / "out"
    with fresh_namespace(redis_url) as ns, smollm2_replica(redis_url, ns):
        keys, conn = Keys(ns), redis.Redis.from_url(redis_url)
        pipeline = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "conveyor",
                "summarize",
                *map(str, texts),
                "--out",
                str(out),
                "--quiet",
                "--redis-url",
                redis_url,
                "--namespace",
                ns,
                "--max-in-flight",
                "3",
                "--max-tokens",
                "24",
                "--context-tokens",
                "256",
            ],
            cwd=REPO_ROOT,
        )
        done_at_kill = wait_for_done_jobs(conn, keys, all_ids, at_least=2, process=pipeline)
        pipeline.send_signal(signal.SIGKILL)
        pipeline.wait(10)
        submitted_before = {i for i in all_ids if conn.exists(keys.job(i))}
        assert len(done_at_kill) >= 2 and len(submitted_before) < len(all_ids), "kill came too late"

        results = summarize_documents(texts, out, redis_url=redis_url, namespace=ns, max_in_flight=8, **OPTIONS)
        assert {r.name: r.summary for r in results} == {n: r.summary for n, r in expected.items()}
        rerun_jobs = [j for r in results for j in r.record["jobs"]]
        assert {j["job_id"] for j in rerun_jobs} == all_ids
        assert {j["job_id"] for j in rerun_jobs if j["enqueued"]} == all_ids - submitted_before
        assert entries_added(redis_url, keys.batch) == len(all_ids)  # nothing enqueued twice
        for result in results:
            assert Path(result.record["summary_file"]).read_text() == f"{expected[result.name].summary}\n"
        conn.close()


def wait_for_done_jobs(conn, keys, job_ids, at_least, process, timeout=120.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the pipeline ended before it could be killed"
        pipe = conn.pipeline(transaction=False)
        for job in job_ids:
            pipe.hget(keys.job(job), "status")
        done = {job for job, status in zip(job_ids, pipe.execute()) if status == b"done"}
        if len(done) >= at_least:
            return done
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} jobs finished within {timeout} s")
