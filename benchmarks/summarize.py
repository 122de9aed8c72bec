"""Our summarization pipeline vs a LangChain map-reduce over our own gateway, and vs the
same jobs sent straight through the queue; alternating rounds in one run.

    python benchmarks/summarize.py [--model smollm2] [--rounds 2] [--max-tokens 64]
                                   [--max-chunk-tokens 384] [--json out.json] [--png out.png]
    python benchmarks/summarize.py --quality [--json out.json]   # grounding tables only

`--quality`: one run of ours over the folder and a table of what grounding
(apps/documents/grounding.py) kept: the share of the final summaries' sentences kept as
grounded points, the filler and ungrounded ones dropped, and how the chunk summaries were
made (model, model retry, extractive). In the same run, concurrently, LangChain's
map-reduce (below) makes one final summary per document over the gateway, same model,
chunks, prompts and max_tokens; then both are scored by the same rules: a point is one of
our cited points, or one sentence (summary_points.sentences) of LangChain's final summary;
it is grounded when grounding.cited_chunks finds a chunk of its document it is grounded
in, filler when grounding.is_filler. Ours also counts its extractive fallbacks and
citations of a chunk its point is not grounded in.

One embedded Valkey, one `conveyor serve` replica and one `conveyor gateway`. The folder
holds mixed documents made here or shipped by Debian: a PDF (fpdf2) and a DOCX
(python-docx) of the bzip2 manual's first paragraphs, an HTML page, a Markdown file.

- ours: `summarize_documents_async` over the folder: parsing (worker processes), chunking,
  map and reduce jobs of every document in flight together (max_in_flight 8), cited points.
- langchain: langchain-openai's ChatOpenAI against the gateway, the map-reduce pattern of
  LangChain's summarization guide: per document, the map prompts through `abatch`
  (max_concurrency 8), then the summaries collapsed by the same grouping until one is
  left; documents one after another, as a chain is invoked per document. Same chunks, same
  prompts, same max_tokens (parsing done for it beforehand, not timed).
- direct: the same jobs as ours, submitted straight with AsyncClient (no parsing, records,
  citations): what the pipeline costs over the queue itself.

Each round gives every mode a system prompt of its own ("Run r-m."), so neither reuses the
other's prefix cache or finished jobs; the order of the modes rotates every round. Prints
the CPU and its ISA, docs/hour and output tok/s per mode (median, min-max), ours/langchain
and the overhead of ours over direct per round. On a shared machine read the spread first.
"""

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, embedded_valkey, spawned_gateway, spawned_replica, write_json  # noqa: E402

MODES = ("ours", "langchain", "direct")
HTML_PAGES = [  # pages Debian packages ship with their documentation (those this machine has)
    Path("/usr/share/doc/libjson-c5/README.html"),
    Path("/usr/share/doc/base-passwd/users-and-groups.html"),
    Path("/usr/share/doc/zlib1g-dev/examples/zlib_how.html"),
    Path("/usr/share/doc/libffi8/html/The-Basics.html"),
]
BZIP2 = Path("/usr/share/doc/bzip2/manual.html")


def make_folder(folder: Path, paragraphs: int) -> list[Path]:
    """A PDF and a DOCX of the bzip2 manual's first paragraphs, an HTML page, the README's start."""
    import docx
    from fpdf import FPDF

    from conveyor.apps.documents.documents import document_from_bytes

    text = document_from_bytes(BZIP2.read_bytes(), BZIP2.name).text.split("\n\n")
    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    for start in range(0, paragraphs, 6):
        pdf.add_page()
        for paragraph in text[start : start + 6]:
            pdf.multi_cell(0, 6, paragraph.encode("latin-1", "replace").decode("latin-1"))
            pdf.ln(3)
    (folder / "bzip2.pdf").write_bytes(bytes(pdf.output()))
    document = docx.Document()
    for paragraph in text[paragraphs : 2 * paragraphs]:
        document.add_paragraph(paragraph)
    buffer = io.BytesIO()
    document.save(buffer)
    (folder / "bzip2-part2.docx").write_bytes(buffer.getvalue())
    for page in filter(Path.exists, HTML_PAGES):
        (folder / f"{page.parent.name}-{page.stem}.html").write_bytes(page.read_bytes())
    readme = Path(__file__).resolve().parents[1] / "README.md"
    (folder / "README.md").write_text(readme.read_text()[:3000])
    return sorted(folder.iterdir())


async def run_ours(client, paths, options) -> int:
    from conveyor.apps.documents.summarize import summarize_documents_async

    results = await summarize_documents_async(paths, client=client, wait_s=60, **options)
    failed = [r.error for r in results if not r.ok]
    assert not failed, failed
    return sum(r.record["usage"]["completion_tokens"] for r in results)


async def run_direct(client, docs, prompts, options) -> int:
    """The map and reduce jobs of every document, straight through the queue."""
    from conveyor.apps.documents.summary_prompts import SummarizeOptions

    settings, semaphore = SummarizeOptions(**options), asyncio.Semaphore(options.get("max_in_flight", 8))

    async def job(messages) -> tuple[str, int]:
        async with semaphore:
            result = await (await client.submit(messages=messages, **settings.job_fields())).result()
        return result.text.strip(), result.usage.completion_tokens

    async def document(doc) -> int:
        tokens, _ = await map_reduce(
            prompts, [c.text for c in prompts.chunks(doc)], lambda ms: asyncio.gather(*map(job, ms))
        )
        return tokens

    return sum(await asyncio.gather(*map(document, docs)))


def langchain_llm(gateway_url: str, model: str, max_tokens: int):
    """langchain-openai's ChatOpenAI on our gateway: greedy, our repetition penalty, no retries."""
    from langchain_openai import ChatOpenAI

    from conveyor.apps.documents.summary_prompts import SummarizeOptions

    llm = ChatOpenAI(
        base_url=f"{gateway_url}/v1",
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=1800,
        frequency_penalty=None,
    )
    return llm.bind(extra_body={"repetition_penalty": SummarizeOptions().repetition_penalty})


async def run_langchain(llm, docs, prompts) -> tuple[int, list[str]]:
    """LangChain's map-reduce: per document, abatch the maps, collapse, one document at a time;
    (output tokens, the final summary of each document)."""
    from langchain_core.messages import HumanMessage, SystemMessage

    def as_langchain(messages):
        kinds = {"system": SystemMessage, "user": HumanMessage}
        return [kinds[m["role"]](content=m["content"]) for m in messages]

    async def batch(messages_list) -> list[tuple[str, int]]:
        replies = await llm.abatch([as_langchain(m) for m in messages_list], config={"max_concurrency": 8})
        return [(r.content.strip(), r.usage_metadata["output_tokens"]) for r in replies]

    tokens, finals = 0, []
    for doc in docs:
        used, final = await map_reduce(prompts, [c.text for c in prompts.chunks(doc)], batch)
        tokens, finals = tokens + used, [*finals, final]
    return tokens, finals


async def map_reduce(prompts, chunks: list[str], run_batch) -> tuple[int, str]:
    """Map every chunk, then reduce groups that fit, level by level; (output tokens, final summary)."""
    replies = await run_batch([prompts.map_messages(c) for c in chunks])
    tokens = sum(n for _, n in replies)
    summaries = [text for text, _ in replies]
    while len(summaries) > 1:
        groups = prompts.groups(summaries)
        replies = await run_batch([prompts.reduce_messages(g) for g in groups])
        tokens += sum(n for _, n in replies)
        summaries = [text for text, _ in replies]
    return tokens, summaries[0] if summaries else ""


async def measure(args, redis_url: str, gateway_url: str, paths: list[Path]) -> dict[str, list[dict]]:
    import httpx

    from conveyor.apps.documents.documents import load_documents
    from conveyor.apps.documents.summary_prompts import Prompts, SummarizeOptions
    from conveyor.clients import AsyncClient
    from conveyor.clients.model_info import wait_for_model_info_async

    base = dict(
        max_tokens=args.max_tokens,
        max_chunk_tokens=args.max_chunk_tokens,
        max_in_flight=8,
        priority_class="interactive",
    )
    docs = load_documents(paths)
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    async with AsyncClient(redis_url) as client:
        info = await wait_for_model_info_async(client.redis, client.keys, None, 600, True)
        model = httpx.get(f"{gateway_url}/v1/models").json()["data"][0]["id"]
        for round_index in range(-1, args.rounds):  # round -1 warms everything up, untimed
            order = MODES[round_index % 3 :] + MODES[: round_index % 3]
            for mode in order:
                options = {**base, "system_prompt": f"Run {round_index}-{mode}."}
                prompts = Prompts(SummarizeOptions(**options), info.token_counter(), info.max_model_len)
                llm = langchain_llm(gateway_url, model, args.max_tokens)
                started = time.perf_counter()
                if mode == "ours":
                    tokens = await run_ours(client, paths, options)
                elif mode == "direct":
                    tokens = await run_direct(client, docs, prompts, options)
                else:
                    tokens, _ = await run_langchain(llm, docs, prompts)
                seconds = time.perf_counter() - started
                if round_index < 0:
                    continue
                row = {
                    "round": round_index,
                    "seconds": seconds,
                    "tokens": tokens,
                    "docs_per_hour": len(docs) * 3600 / seconds,
                    "tok_s": tokens / seconds,
                }
                rows[mode].append(row)
                print(
                    f"round {round_index + 1}/{args.rounds} {mode:>9}: {row['docs_per_hour']:7.1f} docs/h, "
                    f"{row['tok_s']:6.1f} output tok/s ({seconds:.1f} s, {tokens} tokens)",
                    flush=True,
                )
    return rows


def quality(results) -> dict:
    """What grounding kept and dropped over one run's records (see --quality)."""
    records = [r.record for r in results if r.ok]
    dropped = [d for r in records for d in r.get("dropped_points", [])]
    kept = sum(len(r["points"]) for r in records)
    chunks = [c for r in records for c in r["chunks"]]
    step_dropped = [d for c in chunks for d in c.get("dropped", [])]
    table = {
        "documents": len(results),
        "documents failed": len(results) - len(records),
        "documents with warnings": sum(bool(r["warnings"]) for r in records),
        "final sentences": kept + len(dropped),
        "points kept (grounded)": kept,
        "share grounded": kept / max(kept + len(dropped), 1),
        "final sentences dropped as filler": sum(d["reason"] == "filler" for d in dropped),
        "final sentences dropped as ungrounded": sum(d["reason"] == "ungrounded" for d in dropped),
        "chunks": len(chunks),
        "chunk summaries by the model": sum(c.get("origin") == "model" for c in chunks),
        "chunk summaries by the retry": sum(c.get("origin") == "model retry" for c in chunks),
        "chunk summaries extractive": sum(bool(c.get("extractive")) for c in chunks),
        "chunk sentences dropped as filler": sum(d["reason"] == "filler" for d in step_dropped),
        "chunk sentences dropped as ungrounded": sum(d["reason"] == "ungrounded" for d in step_dropped),
    }
    print("\n| measure | value |\n|---|---:|")
    for name, value in table.items():
        print(f"| {name} | {value:.0%} |" if isinstance(value, float) else f"| {name} | {value} |")
    return table


def score(points: list[tuple[str, list[frozenset[str]]]]) -> dict:
    """Points (text, its document's chunk words) scored by the grounding rules."""
    from conveyor.apps.documents.grounding import cited_chunks, is_filler

    grounded = sum(bool(cited_chunks(text, chunk_words)) for text, chunk_words in points)
    return {
        "points": len(points),
        "grounded points": grounded,
        "share grounded": grounded / max(len(points), 1),
        "filler points": sum(is_filler(text) for text, _ in points),
    }


def score_ours(results, chunk_words: dict[str, list[frozenset[str]]]) -> dict:
    """Our cited points, scored again; and our citations of a chunk the point is not grounded in."""
    from conveyor.apps.documents.grounding import content_words, grounded

    records = [r.record for r in results if r.ok]
    points = [(p, chunk_words[r["document"]]) for r in records for p in r["points"]]
    steps = [s for r in records for s in r["chunks"] + r["tree"]]
    return {
        **score([(p["text"], words) for p, words in points]),
        "citations not grounded": sum(
            not grounded(content_words(p["text"]), words[c]) for p, words in points for c in p["chunks"]
        ),
        "extractive fallbacks (chunk summaries + merges)": sum(bool(s.get("extractive")) for s in steps),
        "documents failed": len(results) - len(records),
    }


def score_langchain(docs, finals: list[str], chunk_words: dict[str, list[frozenset[str]]]) -> dict:
    """Each sentence of LangChain's final summary of a document is one point."""
    from conveyor.apps.documents.summary_points import sentences

    return score([(s, chunk_words[doc.name]) for doc, final in zip(docs, finals) for s in sentences(final)])


def side_by_side(ours: dict, langchain: dict) -> None:
    print("\n| measure | ours | LangChain |\n|---|---:|---:|")
    for name, value in ours.items():
        theirs = langchain.get(name, "-")
        cells = [f"{v:.0%}" if isinstance(v, float) else str(v) for v in (value, theirs)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


async def timed(label: str, work) -> object:
    started = time.perf_counter()
    result = await work
    print(f"{label}: {time.perf_counter() - started:.1f} s", flush=True)
    return result


async def measure_quality(args, redis_url: str, gateway_url: str, paths: list[Path]) -> dict:
    """Ours and LangChain's map-reduce over the same documents, concurrently, then scored."""
    import httpx

    from conveyor.apps.documents.documents import load_documents
    from conveyor.apps.documents.grounding import content_words
    from conveyor.apps.documents.summarize import summarize_documents_async
    from conveyor.apps.documents.summary_prompts import Prompts, SummarizeOptions
    from conveyor.clients import AsyncClient
    from conveyor.clients.model_info import wait_for_model_info_async

    options = dict(max_tokens=args.max_tokens, max_chunk_tokens=args.max_chunk_tokens, max_in_flight=8)
    docs = load_documents(paths)
    async with AsyncClient(redis_url) as client:
        info = await wait_for_model_info_async(client.redis, client.keys, None, 600, True)
        prompts = Prompts(SummarizeOptions(**options), info.token_counter(), info.max_model_len)
        chunk_words = {doc.name: [content_words(c.text) for c in prompts.chunks(doc)] for doc in docs}
        llm = langchain_llm(gateway_url, httpx.get(f"{gateway_url}/v1/models").json()["data"][0]["id"], args.max_tokens)
        started = time.perf_counter()
        results, (_, finals) = await asyncio.gather(
            timed("ours", summarize_documents_async(paths, client=client, wait_s=600, **options)),
            timed("langchain", run_langchain(llm, docs, prompts)),
        )
        print(f"{len(paths)} documents, both systems concurrently, in {time.perf_counter() - started:.1f} s")
    table = quality(results)
    versus = {"ours": score_ours(results, chunk_words), "langchain": score_langchain(docs, finals, chunk_words)}
    side_by_side(versus["ours"], versus["langchain"])
    return {
        "quality": table,
        "versus": versus,
        "langchain summaries": {doc.name: final for doc, final in zip(docs, finals)},
        "warnings": {r.name: r.warnings for r in results},
    }


def report(rows: dict[str, list[dict]], args, docs: int) -> dict:
    print(
        f"\n{describe_cpu()}\n{docs} documents x {args.rounds} rounds, {args.model}, max_tokens {args.max_tokens}, "
        f"max_chunk_tokens {args.max_chunk_tokens}"
    )
    summary = {}
    for mode, values in rows.items():
        for metric in ("docs_per_hour", "tok_s"):
            figures = [v[metric] for v in values]
            summary[f"{mode} {metric}"] = {
                "median": statistics.median(figures),
                "min": min(figures),
                "max": max(figures),
            }
            print(
                f"  {mode:>9} {metric:>13}: {statistics.median(figures):8.1f} (min {min(figures):.1f}, "
                f"max {max(figures):.1f})"
            )
    for name, ratio in (
        ("ours / langchain (docs/h)", lambda o, lc, d: o["docs_per_hour"] / lc["docs_per_hour"]),
        ("ours overhead over direct (time)", lambda o, lc, d: o["seconds"] / d["seconds"] - 1),
    ):
        per_round = [ratio(o, lc, d) for o, lc, d in zip(rows["ours"], rows["langchain"], rows["direct"])]
        summary[name] = {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}
        print(f"  {name}: {statistics.median(per_round):.2f} (per round {min(per_round):.2f} to {max(per_round):.2f})")
    return summary


def plot(rows: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.2))
    for position, mode in enumerate(MODES):
        values = [r["docs_per_hour"] for r in rows[mode]]
        axis.bar(
            position,
            statistics.median(values),
            yerr=[[statistics.median(values) - min(values)], [max(values) - statistics.median(values)]],
            capsize=4,
        )
    axis.set_xticks(range(len(MODES)), MODES)
    axis.set_ylabel("documents per hour (median, min-max)")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-chunk-tokens", type=int, default=384)
    parser.add_argument("--paragraphs", type=int, default=24, help="bzip2 manual paragraphs in the PDF and the DOCX")
    parser.add_argument("--quality", action="store_true", help="grounding tables: ours, and ours vs LangChain")
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="conveyor-summarize-bench-") as folder, embedded_valkey() as url:
        paths = make_folder(Path(folder), args.paragraphs)
        if args.quality:
            with spawned_replica(args.model, url, ["--max-num-seqs", "16"]), spawned_gateway(url) as (gateway_url, _):
                result = asyncio.run(measure_quality(args, url, gateway_url, paths))
            print(
                f"\n{describe_cpu()}\n{len(paths)} documents, {args.model}, max_tokens {args.max_tokens}, "
                f"max_chunk_tokens {args.max_chunk_tokens}"
            )
            write_json(args.json, {"cpu": describe_cpu(), **result})
            return
        with spawned_replica(args.model, url, ["--max-num-seqs", "16"]), spawned_gateway(url) as (gateway_url, _):
            rows = asyncio.run(measure(args, url, gateway_url, paths))
        summary = report(rows, args, len(paths))
    if args.png:
        plot(rows, args.png)
    write_json(args.json, {"cpu": describe_cpu(), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
