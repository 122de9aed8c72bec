"""Summaries grounded in their documents (issue 40, item 5): the grounding rule, filler
detection and the extractive fallback on real text, the CLI's exit status and the report's
warnings, and one run of the real pipeline through SmolLM2 and Valkey."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from scratch import scratch_namespace
from summarize_docs import PAGES
from test_summarize import smollm2_replica

from conveyor import cli as conveyor_cli
from conveyor.apps.documents import cli as summarize_cli
from conveyor.apps.documents.documents import Document, load_documents
from conveyor.apps.documents.grounding import (
    cited_chunks,
    content_words,
    grounded,
    is_filler,
    salient_sentences,
    screen,
    word_frequencies,
)
from conveyor.apps.documents.summarize import DocumentSummary, _Record
from conveyor.apps.documents.summary_prompts import SummarizeOptions
from conveyor.apps.documents.summary_report import render
from conveyor.clients import cli

LICENCE = Path("/usr/share/common-licenses/LGPL-3")
NOTES = "\n\n".join(f"# {title}\n\n{text}" for title, text in PAGES)
CHUNKS = [f"{title}\n\n{text}" for title, text in PAGES]
# What SmolLM2-135M-Instruct answered to map prompts before grounding (and other assistant talk).
FILLER = [
    "I'm ready to assist you with your document.",
    "I'm here to help!",
    "Please provide the document you would like me to summarize.",
    "As an AI language model, I cannot read files.",
    "Sure! Here is a summary of the text:",
    "Could you share the text you want summarized?",
    "Let me know if you need anything else.",
    "How can I help you today?",
]
FACTS = [
    "Producers put generation jobs on a Redis stream.",
    "Replicas batch jobs at every decoding step.",
    "The key value cache is a pool of fixed blocks.",
    "Here, the licence grants the right to convey modified versions.",  # "here" inside a fact
    "The Library may be provided under the terms of this License.",
]


# ---------------------------------------------------------------- the rules, no model


def test_filler_is_detected_and_facts_are_not():
    assert [s for s in FILLER if not is_filler(s)] == []
    assert [s for s in FACTS if is_filler(s)] == []


def test_a_sentence_is_grounded_only_by_shared_content_words():
    chunk = content_words(CHUNKS[1])  # batching
    assert grounded(content_words("Replicas batch jobs at every decoding step."), chunk)
    assert grounded(content_words("Sequences are batched."), chunk)  # 1 of its 2 words, stemmed
    assert not grounded(content_words("The key value cache is a pool of fixed blocks."), chunk)
    assert not grounded(content_words("This is about the text and the document."), chunk)  # no content word
    assert grounded(content_words("Each job is small."), chunk)  # 'job': 1 of its 2 words
    assert not grounded(content_words("The job runs on a large cluster of machines."), chunk)  # 1 of 5
    assert content_words("Batches, batched, batching and batch.") == {"batch"}


def test_points_cite_only_chunks_they_share_words_with_never_all():
    words = [content_words(c) for c in CHUNKS]
    assert cited_chunks("Jobs wait in the stream until a replica reads them.", words) == [0]
    assert cited_chunks("The cache maps logical blocks to physical blocks.", words) == [2]
    assert cited_chunks("Paris is the capital of France.", words) == []
    assert cited_chunks("I'm ready to assist you with your document.", words) == []
    for point in FACTS[:3]:
        for index in cited_chunks(point, words):
            assert content_words(point) & words[index]


def test_screening_drops_filler_and_ungrounded_sentences_with_the_reason():
    screened = screen(
        ["I'm ready to assist you.", "Paris is the capital of France.", "The stream keeps jobs safe."],
        content_words(CHUNKS[0]),
    )
    assert screened.kept == ["The stream keeps jobs safe."]
    assert screened.dropped == [
        ("I'm ready to assist you.", "filler"),
        ("Paris is the capital of France.", "ungrounded"),
    ]


def test_the_extractive_fallback_takes_the_most_salient_sentences_in_order():
    frequencies = word_frequencies(NOTES)
    assert salient_sentences(CHUNKS[0], frequencies) == [
        "Each job waits in the stream until a replica reads it.",
        "The stream keeps jobs safe while replicas restart.",
    ]
    licence = LICENCE.read_text()
    definitions = "\n\n".join(licence.split("\n\n")[3:10])  # a heading and six wrapped paragraphs
    picked = salient_sentences(definitions, word_frequencies(licence))
    assert picked == [
        'A "Combined Work" is a work produced by combining or linking an Application with the Library.',
        "The particular version of the Library with which the Combined Work was made is also called "
        'the "Linked Version".',
    ]


def record_of_chunks(chunks: list[str]) -> _Record:
    """A document's record with these chunks (a run's settings stand in: only names are read)."""
    run = SimpleNamespace(info=SimpleNamespace(name="smollm2"), prompts=SimpleNamespace(context=256))
    run.options = SummarizeOptions()
    record = _Record(Document("notes.md", "\n\n".join(chunks)), run)
    record.data["chunks"] = [
        {"index": i, "pages": None, "headings": [str(i)], "lines": [1, 1]} for i in range(len(chunks))
    ]
    return record


def test_final_points_lose_filler_and_ungrounded_sentences_and_a_thin_summary_warns():
    record = record_of_chunks(CHUNKS)
    words = [content_words(c) for c in CHUNKS]
    final = "I'm ready to assist you with your document. Paris is in France. Replicas batch jobs at every step."
    summary = record.add_points(final, CHUNKS, words)
    assert summary == "- Replicas batch jobs at every step. [§ 1]"
    assert record.data["dropped_points"] == [
        {"text": "I'm ready to assist you with your document.", "reason": "filler"},
        {"text": "Paris is in France.", "reason": "ungrounded"},
    ]
    assert record.data["warnings"] == ["thin summary: 1 grounded point, fewer than 2"]


def test_with_no_grounded_point_the_chunk_summaries_stand_in_with_a_warning():
    record = record_of_chunks(CHUNKS)
    words = [content_words(c) for c in CHUNKS]
    leaves = ["The stream keeps jobs safe.", "Sure! Here it is.", "The cache is a pool of fixed blocks."]
    summary = record.add_points("I'm here to help!", leaves, words)
    assert summary.splitlines() == [
        "- The stream keeps jobs safe. [§ 0]",
        "- The cache is a pool of fixed blocks. [§ 2]",
    ]
    assert "no point of the final summary is grounded" in record.data["warnings"][0]


# ---------------------------------------------------------------- exit status and report


def summary(warnings: list[str], error: str | None = None) -> DocumentSummary:
    record = {"document": "a.txt", "status": "error" if error else "done", "warnings": warnings, "error": error}
    return DocumentSummary("a.txt", None, None if error else "- point [p. 1]", error, record)


def test_exit_status_says_done_with_warnings_and_a_failure_wins():
    assert summarize_cli.exit_status([summary([]), summary([])]) == cli.EXIT_OK == 0
    assert summarize_cli.exit_status([summary([]), summary(["thin summary"])]) == 3
    assert summarize_cli.EXIT_DONE_WITH_WARNINGS == 3
    assert summarize_cli.exit_status([summary(["thin"]), summary([], error="a.txt: failed")]) == cli.EXIT_JOB_FAILED
    help_text = summarize_cli.SUMMARIZE_DESCRIPTION
    assert "3 every document done, some with warnings" in help_text


def test_the_report_shows_warnings_and_extractive_chunks():
    record = {
        "document": "a.txt",
        "status": "done",
        "warnings": ["thin summary: 1 grounded point, fewer than 2"],
        "points": [{"text": "Jobs wait.", "chunks": [0], "cite": "lines 1-2"}],
        "chunks": [{"index": 0, "cite": "lines 1-2", "summary": "Jobs wait.", "extractive": True}],
        "tree": [],
    }
    page = render([record])
    assert "(1 with warnings)" in page and "warning: thin summary: 1 grounded point" in page
    assert "[extractive]</em> Jobs wait." in page


# ---------------------------------------------------------------- the real pipeline on SmolLM2


@pytest.mark.slow
def test_a_real_run_keeps_only_grounded_points_and_its_exit_status_matches_its_warnings(redis_url, tmp_path, capsys):
    (tmp_path / "notes.md").write_text(NOTES)
    out = tmp_path / "out"
    with scratch_namespace(redis_url) as ns, smollm2_replica(redis_url, ns):
        code = conveyor_cli.main(
            ["summarize", str(tmp_path / "notes.md"), "--out", str(out), "--quiet", "--redis-url", redis_url]
            + ["--namespace", ns, "--max-tokens", "40", "--context-tokens", "512", "--max-chunk-tokens", "60"]
        )
    err = capsys.readouterr().err
    record = json.loads((out / "notes.md.summary.json").read_text())
    assert record["status"] == "done", record["error"]
    assert code == (3 if record["warnings"] else 0), (code, record["warnings"])
    assert [line.split(": ", 2)[2] for line in err.splitlines() if line.startswith("warning: ")] == record["warnings"]
    text = load_documents([tmp_path / "notes.md"])[0].text
    chunks = [content_words(text[c["start"] : c["end"]]) for c in record["chunks"]]
    assert len(chunks) >= 2 and record["points"]
    for point in record["points"]:
        assert not is_filler(point["text"]), point
        assert point["chunks"] and all(content_words(point["text"]) & chunks[i] for i in point["chunks"]), point
    for chunk in record["chunks"]:
        assert chunk["summary"] and not any(is_filler(s) for s in chunk["summary"].split(". "))
        assert chunk["extractive"] == (chunk["origin"] == "extractive")
    extractive = [c["index"] for c in record["chunks"] if c["extractive"]]
    assert bool(extractive) == any("chunk summaries are extractive" in w for w in record["warnings"])
    assert (len(record["points"]) < 2) <= bool(record["warnings"])


def test_the_extractive_fallback_is_cut_to_max_tokens():
    """A "sentence" of a list or of code can be a whole paragraph: the fallback is cut to
    max_tokens like a model's answer, so the reduce tree's groups still fit."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from conveyor.apps.documents.summarize import PipelineRun
    from conveyor.clients.token_counter import TokenCounter

    words = [f"item{i}" for i in range(40)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    run = SimpleNamespace(prompts=SimpleNamespace(counter=TokenCounter(tokenizer, None, {})))
    run.options = SimpleNamespace(max_tokens=8)
    paragraph = " ".join(words)  # one "sentence": no full stop anywhere
    assert PipelineRun._within_max_tokens(run, paragraph) == " ".join(words[:8])
    assert PipelineRun._within_max_tokens(run, "item1 item2") == "item1 item2"
