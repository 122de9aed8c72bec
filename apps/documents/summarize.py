"""Summarize documents through the queue: map-reduce over token-budgeted chunks.

    from conveyor.apps.documents.summarize import summarize_documents
    results = summarize_documents(["report.txt", "docs/"], out_dir="summaries", max_tokens=96)

Map: one job per chunk, each prompt starting with the same instruction. Reduce: the chunk
summaries are combined, level after level, until one summary remains. Every job id is a
hash of what the job computes (document content, step, prompt, parameters, model) and
submitting a known id is a no-op, so a rerun after a crash or Ctrl-C waits on the jobs
already queued or finished and submits only the missing ones.

A document has a summary only when every job of its tree finished with text: a job that
failed, timed out or answered no text at all (empty once cut to finished sentences: a
misconfigured job, which no retry mends) makes the document an error naming that job and
its id, once the other jobs of its level have finished (for a rerun to reuse). A reduce over
empty chunk summaries would otherwise invent a summary of nothing.

Grounding (grounding.py): a job's sentences that are assistant filler or not grounded in the
chunks it covers are dropped; a job left with none is retried once with another instruction,
then replaced by the most salient sentences of its input (`extractive` in the record). The
final points are kept only where grounded and cite only the chunks they are grounded in. A
document with fewer than MIN_GROUNDED_POINTS points or any extractive step ends `done` with
`warnings`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from conveyor.apps.documents.chunking import Chunk
from conveyor.apps.documents.doc_layout import Locator, citation_label, citation_of
from conveyor.apps.documents.documents import Document, UnsafeOutputPath, load_documents, summary_path, write_outputs
from conveyor.apps.documents.grounding import (
    cited_chunks,
    content_words,
    is_filler,
    salient_sentences,
    screen,
    word_frequencies,
)
from conveyor.apps.documents.summary_points import deduplicated, finished, sentences, without_repeats
from conveyor.apps.documents.summary_prompts import Messages, Prompts, SummarizeError, SummarizeOptions, job_id
from conveyor.apps.documents.summary_report import write_report
from conveyor.clients.async_client import AsyncClient, AsyncJob
from conveyor.clients.errors import JobFailed, Timeout
from conveyor.clients.event_reader import JobResult
from conveyor.clients.model_info import DEFAULT_MODEL_WAIT_S, ModelInfo, wait_for_model_info_async

__all__ = ["DocumentSummary", "SummarizeError", "SummarizeOptions", "summarize_documents", "summarize_documents_async"]

RETRIED_STATUSES = ("error", "cancelled")
MIN_GROUNDED_POINTS = 2  # fewer grounded points: a thin summary, `done` with a warning
MAX_FALLBACK_POINTS = 6  # points taken from chunk summaries when the final summary has none grounded


@dataclass
class DocumentSummary:
    """Outcome for one document: `summary` or `error`, and the run record (also in JSON).
    When the summary was made but its files could not be written, both are set."""

    name: str
    source: str | None
    summary: str | None
    error: str | None
    record: dict[str, Any] = field(repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def warnings(self) -> list[str]:
        """Why a `done` summary deserves a second look (thin, partly extractive); [] if clean."""
        return list(self.record.get("warnings") or [])


@dataclass(frozen=True)
class _Step:
    """One map or reduce job to ground: its prompt, its retry's prompt, the content words of the
    chunks it covers (what its sentences must be grounded in), the text to extract from."""

    messages: Messages
    retry_messages: Messages
    source_words: frozenset[str]
    extract_from: str


@dataclass(frozen=True)
class _Outcome:
    """A screened step: its kept text, where that came from ("model", "model retry",
    "extractive") and the sentences dropped on the way, with why."""

    text: str
    origin: str
    dropped: list[dict[str, str]]

    @property
    def extractive(self) -> bool:
        return self.origin == "extractive"


def summarize_documents(
    sources: Iterable[str | Path | Document],
    out_dir: str | Path | None = None,
    *,
    redis_url: str | None = None,
    namespace: str | None = None,
    progress: bool = False,
    wait_s: float = DEFAULT_MODEL_WAIT_S,
    **options: Any,
) -> list[DocumentSummary]:
    """Summarize files, folders and Documents; `options` are SummarizeOptions fields.

    Writes `<name>.summary.txt` and `<name>.summary.json` per document into `out_dir`
    when given, and OUT/index.html (summary_report) over every record there. Names are made safe (see documents.safe_name), symlinks inside input
    folders are skipped as errors and outputs never go through a symlink (see
    documents.load_documents and documents.write_outputs); a document whose outputs cannot
    be written gets that error, the others are still summarized.

    Waits up to `wait_s` seconds (0: not at all) for a replica to publish its model info,
    so a pipeline may start before its replicas have loaded their model (a line on stderr
    every few seconds when `progress`); then raises ModelNotPublished naming the limit.
    """
    return asyncio.run(
        summarize_documents_async(
            sources, out_dir, redis_url=redis_url, namespace=namespace, progress=progress, wait_s=wait_s, **options
        )
    )


async def summarize_documents_async(
    sources: Iterable[str | Path | Document],
    out_dir: str | Path | None = None,
    *,
    client: AsyncClient | None = None,
    redis_url: str | None = None,
    namespace: str | None = None,
    progress: bool = False,
    wait_s: float = DEFAULT_MODEL_WAIT_S,
    **options: Any,
) -> list[DocumentSummary]:
    """summarize_documents as a coroutine, optionally on an existing AsyncClient."""
    settings = SummarizeOptions(**options)
    documents = load_documents(sources)
    owned = client is None
    client = client or AsyncClient(redis_url, namespace)
    try:
        info = await wait_for_model_info_async(client.redis, client.keys, settings.model, wait_s, progress)
        run = PipelineRun(client, info, settings, Path(out_dir) if out_dir else None, progress, len(documents))
        try:
            results = list(await asyncio.gather(*(run.summarize(doc) for doc in documents)))
        finally:
            run.close()
        if out_dir:
            write_report(Path(out_dir))
        return results
    finally:
        if owned:
            await client.close()


class PipelineRun:
    """One pipeline run: shared prompts, the bound on jobs in flight, progress bars."""

    def __init__(
        self,
        client: AsyncClient,
        info: ModelInfo,
        options: SummarizeOptions,
        out_dir: Path | None,
        progress: bool,
        documents: int,
    ) -> None:
        self.client, self.info, self.options, self.out_dir = client, info, options, out_dir
        self.prompts = Prompts(options, info.token_counter(), info.max_model_len)
        self.in_flight = asyncio.Semaphore(options.max_in_flight)
        self.documents_bar = tqdm(total=documents, desc="documents", unit="doc", disable=not progress, position=0)
        self.jobs_bar = tqdm(total=0, desc="jobs (chunks + merges)", unit="job", disable=not progress, position=1)
        self.tokens = 0  # completion tokens of this run's jobs
        self.jobs_total = self.jobs_done = 0  # the bars' counts, kept when the bars are off

    def close(self) -> None:
        self.jobs_bar.close()
        self.documents_bar.close()

    async def summarize(self, doc: Document) -> DocumentSummary:
        record = _Record(doc, self)
        try:
            summary, error = await self._summarize(doc, record), None
        except SummarizeError as exc:
            summary, error = None, f"{doc.name}: {exc.message}"
        written = self.out_dir and summary is not None
        record.finish(summary, error, str(summary_path(self.out_dir, doc)) if written else None)
        if self.out_dir:
            error = self._write(doc, summary, record) or error
        self.documents_bar.update()
        return DocumentSummary(doc.name, doc.source, summary, error, record.data)

    def _write(self, doc: Document, summary: str | None, record: _Record) -> str | None:
        """Write one document's outputs; a failure is that document's error, not the run's."""
        try:
            write_outputs(self.out_dir, doc, summary, record.data)
        except (OSError, UnsafeOutputPath) as exc:
            earlier = record.data["error"]  # e.g. a skipped symlink: keep it first
            if earlier:
                error = f"{earlier}; its outputs cannot be written either: {exc}"
            else:
                error = f"{doc.name}: cannot write its outputs: {exc}"
            record.fail(error)
            return error
        return None

    async def _summarize(self, doc: Document, record: _Record) -> str:
        problem = doc.problem()
        if problem:
            raise SummarizeError(problem)
        try:
            chunks = self.prompts.chunks(doc)
        except ValueError as exc:
            raise SummarizeError(str(exc)) from None
        record.add_chunks(doc, chunks, self.prompts)
        if self.options.schema_ is not None:
            return await self._summarize_json(doc, record, chunks)
        return await self._summarize_grounded(doc, record, chunks)

    async def _summarize_json(self, doc: Document, record: _Record, chunks: list[Chunk]) -> str:
        """Every step answers JSON under the schema; the final JSON is validated."""
        leaves, _ = await self._level(doc, record, "map", 0, [self.prompts.map_messages(c.text) for c in chunks])
        record.add_chunk_summaries(leaves)
        summaries, covered, level = leaves, [[i] for i in range(len(leaves))], 0
        while len(summaries) > 1:
            level += 1
            groups = self.prompts.group_indices(summaries)
            prompts = [self.prompts.reduce_messages([summaries[i] for i in g]) for g in groups]
            summaries, _ = await self._level(doc, record, "reduce", level, prompts)
            covered = [[leaf for i in group for leaf in covered[i]] for group in groups]
            record.add_reduce_level(level, groups, covered, summaries)
        return record.add_final_json(summaries[0], self.options.schema_)

    async def _summarize_grounded(self, doc: Document, record: _Record, chunks: list[Chunk]) -> str:
        """Map-reduce where every step keeps only grounded, non-filler sentences (grounding.py)."""
        chunk_words = [content_words(c.text) for c in chunks]
        frequencies = word_frequencies(doc.text)
        steps = [
            _Step(self.prompts.map_messages(c.text), self.prompts.retry_map_messages(c.text), chunk_words[i], c.text)
            for i, c in enumerate(chunks)
        ]
        leaves = await self._grounded_level(doc, record, "map", 0, steps, frequencies)
        record.add_chunk_summaries([leaf.text for leaf in leaves], leaves)
        summaries, covered, level = [leaf.text for leaf in leaves], [[i] for i in range(len(leaves))], 0
        while len(summaries) > 1:
            level += 1
            groups = self.prompts.group_indices(summaries)
            covered = [[leaf for i in group for leaf in covered[i]] for group in groups]
            steps = [
                _Step(
                    self.prompts.reduce_messages([summaries[i] for i in g]),
                    self.prompts.retry_reduce_messages([summaries[i] for i in g]),
                    frozenset().union(*(chunk_words[c] for c in leaves_of)),
                    "\n".join(summaries[i] for i in g),
                )
                for g, leaves_of in zip(groups, covered)
            ]
            merged = await self._grounded_level(doc, record, "reduce", level, steps, frequencies)
            summaries = [node.text for node in merged]
            record.add_reduce_level(level, groups, covered, summaries, merged)
        summary = record.add_points(summaries[0], [leaf.text for leaf in leaves], chunk_words)
        if not summary:
            raise SummarizeError("no sentence of the summary or of the chunk summaries is grounded in the document")
        return summary

    async def _grounded_level(
        self,
        doc: Document,
        record: _Record,
        kind: str,
        level: int,
        steps: list[_Step],
        frequencies: Any,
    ) -> list[_Outcome]:
        """One level's jobs, each screened, retried once when nothing usable is left, and
        replaced by the salient sentences of its input when the retry fails too."""
        self._count_jobs(len(steps))
        outcomes = await asyncio.gather(
            *(
                self._grounded_job(doc, record, kind, level, index, step, frequencies)
                for index, step in enumerate(steps)
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)

    async def _grounded_job(
        self, doc: Document, record: _Record, kind: str, level: int, index: int, step: _Step, frequencies: Any
    ) -> _Outcome:
        dropped: list[dict[str, str]] = []
        for retry, messages in ((False, step.messages), (True, step.retry_messages)):
            if retry:
                self._count_jobs(1)
            text, _ = await self._job(doc, record, kind, level, index, messages, retry=retry)
            screened = screen(sentences(text), step.source_words)
            dropped += [{"text": sentence, "reason": reason} for sentence, reason in screened.dropped]
            if screened.kept:
                return _Outcome(screened.text, "model retry" if retry else "model", dropped)
        fallback = " ".join(salient_sentences(step.extract_from, frequencies)) or step.extract_from.strip()
        return _Outcome(self._within_max_tokens(fallback), "extractive", dropped)

    def _within_max_tokens(self, text: str) -> str:
        """``text`` cut to max_tokens, as a model's answer would be: the reduce tree's groups
        assume every summary fits (a "sentence" of a list or code can be a whole paragraph)."""
        counter, cap = self.prompts.counter, self.options.max_tokens
        spans = counter.offsets(text)
        return text if len(spans) <= cap else text[: spans[cap - 1][1]].rstrip()

    def _count_jobs(self, count: int) -> None:
        self.jobs_bar.total += count
        self.jobs_total += count
        self.jobs_bar.refresh()

    async def _level(
        self, doc: Document, record: _Record, kind: str, level: int, prompts: list[Messages]
    ) -> tuple[list[str], list[str]]:
        """Run one level's jobs: (their texts, their job ids). All of them finish (for a rerun to
        reuse) before a failure is raised: the first one's, in index order."""
        self._count_jobs(len(prompts))
        outcomes = await asyncio.gather(
            *(self._job(doc, record, kind, level, index, messages) for index, messages in enumerate(prompts)),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [text for text, _ in outcomes], [key for _, key in outcomes]

    async def _job(
        self,
        doc: Document,
        record: _Record,
        kind: str,
        level: int,
        index: int,
        messages: Messages,
        retry: bool = False,
    ) -> tuple[str, str]:
        """(text, job id) of one job. Raises SummarizeError naming the job and its id when it
        failed, timed out or (unless a retry) answered no text."""
        step = {"kind": kind, "level": level, "index": index, **({"retry": True} if retry else {})}
        job_key = job_id(f"{kind}-retry" if retry else kind, doc, level, index, messages, self.options, self.info.name)
        name = f"{kind} job {index} of level {level}{' (retry)' if retry else ''} ({job_key})"
        async with self.in_flight:
            if self.options.retry_failed:
                await self._forget_failure(job_key)
            job = await self.client.submit(
                job_id=job_key,
                messages=messages,
                model=self.options.model,
                metadata={"pipeline": "summarize", "document": doc.name, **step},
                **self.options.job_fields(),
            )
            try:
                result = await job.result(timeout=self.options.job_timeout)
            except JobFailed as exc:
                record.add_job(step, job, error=exc.message)
                raise SummarizeError(f"{name} failed [{exc.code}]: {exc.reason}") from None
            except Timeout as exc:
                record.add_job(step, job, error=exc.message)
                raise SummarizeError(f"{name} gave no result within {self.options.job_timeout:g} s") from None
        record.add_job(step, job, result)
        self.jobs_bar.update()
        self.jobs_done += 1
        self.tokens += result.usage.completion_tokens
        if self.options.schema_ is not None:
            return _complete_json(result, name, self.options.max_tokens), job_key
        text = cleaned(result.text)
        if not text and not retry:  # a retry's empty answer leads to the extractive fallback
            raise SummarizeError(
                f"{name} returned an empty summary ({_said(result)}); the document's summary would miss it"
            )
        return text, job_key

    async def _forget_failure(self, job_key: str) -> None:
        """Let a job that failed in an earlier run be submitted again."""
        if (await self.client.job(job_key).status()).status in RETRIED_STATUSES:
            await self.client.redis.delete(self.client.keys.job(job_key), self.client.keys.out(job_key))


def cleaned(text: str) -> str:
    """A job's text without a cut-off last sentence and without looping repeats; when the cut
    leaves nothing (`1. The licence grants` cut at max_tokens: `1.` is a list number, not a
    sentence), the text uncut, less its repeats. Empty when the model said nothing usable."""
    return deduplicated(finished(text)) or deduplicated(text)


def _describe(node: dict[str, Any], outcome: _Outcome) -> None:
    """Where a chunk's or merge's summary came from, in its record entry."""
    node.update(origin=outcome.origin, extractive=outcome.extractive, dropped=outcome.dropped)


def _leading_sentences(leaves: list[str], chunk_words: list[frozenset[str]]) -> list[tuple[str, list[int]]]:
    """(sentence, cited chunks): the first grounded sentence of each chunk summary, at most
    MAX_FALLBACK_POINTS, without repeats."""
    points: list[tuple[str, list[int]]] = []
    for leaf in leaves:
        for sentence in sentences(leaf):
            chunks = cited_chunks(sentence, chunk_words)
            if chunks and not is_filler(sentence):
                points.append((sentence, chunks))
                break
    kept = set(without_repeats([p for p, _ in points]))
    return [(p, c) for p, c in points if p in kept][:MAX_FALLBACK_POINTS]


def _said(result: JobResult) -> str:
    raw = result.text.strip()
    shown = f"{raw[:40]!r}{'...' if len(raw) > 40 else ''}" if raw else "no text"
    return f"{shown}, {result.usage.completion_tokens} tokens, finish_reason {result.finish_reason}"


def _complete_json(result: JobResult, step: str, max_tokens: int) -> str:
    try:
        json.loads(result.text)
    except ValueError:
        cut = (
            f" (cut at max_tokens {max_tokens}: raise it or bound the schema's strings)"
            if result.finish_reason == "length"
            else ""
        )
        raise SummarizeError(f"{step} returned incomplete JSON{cut}") from None
    return result.text.strip()


class _Record:
    """The JSON record of one document: chunks, jobs, tokens, timings."""

    def __init__(self, doc: Document, run: PipelineRun) -> None:
        self.started = time.monotonic()
        self.data: dict[str, Any] = {
            "document": doc.name,
            "source": doc.source,
            "sha256": doc.sha256,
            "characters": len(doc.text),
            "format": doc.format,
            "encoding": doc.encoding,
            "model": run.info.name,
            "context_tokens": run.prompts.context,
            "options": run.options.model_dump(by_alias=True),
            "chunks": [],
            "tree": [],
            "points": [],
            "jobs": [],
            "warnings": [],
        }

    def add_chunks(self, doc: Document, chunks: list[Chunk], prompts: Prompts) -> None:
        self.data["chunking_s"] = round(time.monotonic() - self.started, 4)
        self.data["chunks"] = []
        locator = Locator(doc.text, doc.spans)
        for c in chunks:
            coords = locator.coordinates(c.start, c.end)
            self.data["chunks"].append(
                {
                    "index": c.index,
                    **coords,
                    "cite": citation_label(coords),
                    "tokens": prompts.counter.count(c.text, False),
                    "prompt_tokens": prompts.counter.count_chat(prompts.map_messages(c.text)),
                    "summary": None,
                }
            )

    def add_chunk_summaries(self, summaries: list[str], outcomes: list[_Outcome] | None = None) -> None:
        for index, (chunk, summary) in enumerate(zip(self.data["chunks"], summaries)):
            chunk["summary"] = summary
            if outcomes is not None:
                _describe(chunk, outcomes[index])

    def add_reduce_level(
        self,
        level: int,
        groups: list[list[int]],
        covered: list[list[int]],
        summaries: list[str],
        outcomes: list[_Outcome] | None = None,
    ) -> None:
        """One level of the reduce tree: which nodes of the level below each merge read."""
        for index, (group, leaves, summary) in enumerate(zip(groups, covered, summaries)):
            node = {
                "level": level,
                "index": index,
                "inputs": group,
                "chunks": leaves,
                "cite": self._cite(leaves),
                "summary": summary,
            }
            if outcomes is not None:
                _describe(node, outcomes[index])
            self.data["tree"].append(node)

    def add_points(self, final: str, leaves: list[str], chunk_words: list[frozenset[str]]) -> str:
        """The final summary as cited points: filler and points grounded in no chunk dropped,
        each kept one citing only the chunks it is grounded in. When none is left, the first
        grounded sentences of the chunk summaries stand in (with a warning)."""
        points, dropped = [], []
        for point in without_repeats(sentences(final)):
            filler = is_filler(point)
            chunks = [] if filler else cited_chunks(point, chunk_words)
            if chunks:
                points.append((point, chunks))
            else:
                dropped.append({"text": point, "reason": "filler" if filler else "ungrounded"})
        self.data["dropped_points"] = dropped
        if not points:
            points = _leading_sentences(leaves, chunk_words)
            self.warn(
                "no point of the final summary is grounded in the document: the points are the chunk "
                "summaries' first sentences"
            )
        elif len(points) < MIN_GROUNDED_POINTS:
            self.warn(f"thin summary: {len(points)} grounded point, fewer than {MIN_GROUNDED_POINTS}")
        self._warn_extractive()
        lines = []
        for point, chunks in points:
            cite = self._cite(chunks)
            self.data["points"].append({"text": point, "chunks": chunks, "cite": cite})
            lines.append(f"- {point} [{cite}]")
        return "\n".join(lines)

    def warn(self, warning: str) -> None:
        self.data["warnings"].append(warning)

    def _warn_extractive(self) -> None:
        chunks = [c["index"] for c in self.data["chunks"] if c.get("extractive")]
        if chunks:
            self.warn(
                f"{len(chunks)} of {len(self.data['chunks'])} chunk summaries are extractive (the model's "
                f"answers were filler or not grounded in the chunk, twice): chunks {chunks}"
            )
        merges = [f"{n['level']}.{n['index']}" for n in self.data["tree"] if n.get("extractive")]
        if merges:
            self.warn(
                f"{len(merges)} of {len(self.data['tree'])} merges are extractive (the model's answers were "
                f"filler or not grounded in their chunks, twice): nodes {merges}"
            )

    def add_final_json(self, final: str, schema: dict[str, Any]) -> str:
        """The final JSON, validated against the schema (an invalid one is the document's error)."""
        import jsonschema

        try:
            value = json.loads(final)
            jsonschema.validate(value, schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            message = exc.message if isinstance(exc, jsonschema.ValidationError) else str(exc)
            raise SummarizeError(f"the final summary is not JSON under the schema: {message}") from None
        self.data["summary_json"] = value
        return json.dumps(value, indent=2, ensure_ascii=False)

    def _cite(self, chunks: list[int]) -> str:
        return citation_of([self.data["chunks"][i] for i in chunks])

    def add_job(
        self, step: dict[str, Any], job: AsyncJob, result: JobResult | None = None, error: str | None = None
    ) -> None:
        entry = {**step, "job_id": job.job_id, "enqueued": job.enqueued}
        if result is not None:
            entry.update(
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                finish_reason=result.finish_reason,
                attempt=result.attempt,
                timings=result.timings.model_dump(),
            )
        if error is not None:
            entry["error"] = error
        self.data["jobs"].append(entry)

    def finish(self, summary: str | None, error: str | None, summary_file: str | None) -> None:
        jobs = sorted(self.data["jobs"], key=lambda j: (j["level"], j["index"]))
        self.data.update(
            jobs=jobs,
            status="error" if error else "done",
            error=error,
            summary_file=summary_file,
            levels=max((j["level"] for j in jobs), default=-1) + 1,
            submitted=sum(bool(j["enqueued"]) for j in jobs),
            reused=sum(not j["enqueued"] for j in jobs),
            usage={name: sum(j.get(name, 0) for j in jobs) for name in ("prompt_tokens", "completion_tokens")},
            wall_s=round(time.monotonic() - self.started, 3),
            summary=summary,
        )

    def fail(self, error: str) -> None:
        """The outputs could not be written: the record says so (in the returned result)."""
        self.data.update(status="error", error=error, summary_file=None)
