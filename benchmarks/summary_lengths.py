"""Where SmolLM2 starts to repeat itself when summarizing: chunk sizes x repetition penalty.

    python benchmarks/summary_lengths.py [--model smollm2] [--sizes 256 512 1024 2048 4096]
                                         [--penalties 1.0 1.15] [--json out.json] [--png out.png]

Chunks of the bzip2 manual (an HTML page Debian ships), cut at paragraph ends to each size
in tokens, summarized greedily with the pipeline's map instruction and max_tokens. For each
summary: the share of its sentences that repeat an earlier one (summary_points' test of a
repeated point), whether it hit max_tokens (`length`), and whether the raw text ends on a
finished sentence. The chosen defaults (max_chunk_tokens, repetition_penalty, max_tokens)
come from this table; docs/summarize.md records a run.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu  # noqa: E402

from conveyor.apps.documents.documents import document_from_bytes  # noqa: E402
from conveyor.apps.documents.summary_points import FINISHED, SAME_POINT, content_words, sentences  # noqa: E402
from conveyor.apps.documents.summary_prompts import DEFAULT_MAP_INSTRUCTION, SummarizeOptions  # noqa: E402

SOURCE = Path("/usr/share/doc/bzip2/manual.html")


def repeated_share(text: str) -> float:
    seen, repeats, parts = [], 0, sentences(text)
    for part in parts:
        words = content_words(part)
        if any(len(words & s) / max(len(words | s), 1) >= SAME_POINT for s in seen):
            repeats += 1
        seen.append(words)
    return repeats / max(len(parts), 1)


def chunks_of(text: str, tokenizer, size: int, count: int) -> list[str]:
    """`count` consecutive chunks of about `size` tokens, ended at a paragraph."""
    chunks, current, tokens = [], [], 0
    for paragraph in text.split("\n\n"):
        n = len(tokenizer.encode(paragraph, add_special_tokens=False))
        if tokens + n > size and current:
            chunks.append("\n\n".join(current))
            current, tokens = [], 0
            if len(chunks) == count:
                break
        current.append(paragraph)
        tokens += n
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--penalties", type=float, nargs="+", default=[1.0, 1.15])
    parser.add_argument("--chunks", type=int, default=3, help="chunks per size")
    parser.add_argument("--max-tokens", type=int, default=SummarizeOptions().max_tokens)
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    from conveyor.engine import LLM, SamplingParams

    print(describe_cpu(), flush=True)
    llm = LLM(args.model, max_model_len=8192)
    text = document_from_bytes(SOURCE.read_bytes(), SOURCE.name).text
    rows = []
    for size in args.sizes:
        chunks = chunks_of(text, llm.get_tokenizer(), size, args.chunks)
        for penalty in args.penalties:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=penalty)
            started = time.perf_counter()
            outputs = llm.chat(
                [[{"role": "user", "content": f"{DEFAULT_MAP_INSTRUCTION}\n\n{c}"}] for c in chunks],
                params,
                use_tqdm=False,
            )
            done = [o.outputs[0] for o in outputs]
            row = {
                "chunk_tokens": size,
                "repetition_penalty": penalty,
                "repeated_share": round(sum(repeated_share(o.text) for o in done) / len(done), 3),
                "hit_length": sum(o.finish_reason == "length" for o in done) / len(done),
                "ends_finished": sum(bool(FINISHED.search(o.text.strip())) for o in done) / len(done),
                "mean_tokens": sum(len(o.token_ids) for o in done) / len(done),
                "seconds": round(time.perf_counter() - started, 1),
                "example": done[0].text[:300],
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "example"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": describe_cpu(), "rows": rows}, indent=2))
    if args.png:
        plot(rows, args.png)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for penalty in sorted({r["repetition_penalty"] for r in rows}):
        mine = [r for r in rows if r["repetition_penalty"] == penalty]
        axis.plot(
            [r["chunk_tokens"] for r in mine],
            [r["repeated_share"] for r in mine],
            marker="o",
            label=f"repetition_penalty {penalty}",
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("chunk tokens")
    axis.set_ylabel("share of repeated sentences")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    main()
