"""Prompt-lookup speculative decoding on summarization jobs: the engine with and without
``speculative_config`` in alternating rounds, in one process.

    nice -n 19 python benchmarks/speculative.py [--model smollm2] [--concurrency 1,4,16]
        [--rounds 3] [--document /usr/share/common-licenses/GPL-3] [--doc-tokens 1000]
        [--max-tokens 128] [--speculative-config '{"method": "ngram", ...}'] [--json out.json]

Each job is a map prompt of the summarization pipeline (clients/summary_prompts.py: its
instruction, then an excerpt of ``--doc-tokens`` tokens of the document; each job and round
its own excerpt), greedy, up to ``--max-tokens`` summary tokens. A run is ``c`` jobs at once
(``c`` = 1: two jobs one after the other). Every round runs both engines on the same jobs,
in turns, and checks their outputs are token-identical. Printed per concurrency: output
tokens/s end to end (prefill included, as a pipeline sees it) and while decoding (1 / the
median time per output token after the first), the with / without ratio of each per round
(median and range), the acceptance rate and the tokens a drafting step emits on average.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, format_table, write_json  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
MODES = ("off", "ngram")
SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def make_engines(args) -> dict:
    from conveyor.engine import LLM

    options = dict(
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
    )
    return {
        "off": LLM(args.model, **options),
        "ngram": LLM(args.model, speculative_config=args.speculative_config, **options),
    }


def make_jobs(tokenizer, text: str, count: int, round_index: int, doc_tokens: int) -> list:
    """``count`` map prompts, each on its own excerpt (new starts every round: no prefix
    cache help across jobs beyond the shared instruction)."""
    from conveyor.apps.documents.summary_prompts import Prompts, SummarizeOptions

    prompts = Prompts(SummarizeOptions(), None, 8192)
    ids = tokenizer.encode(text, add_special_tokens=False)
    span = max(1, len(ids) - doc_tokens)
    jobs = []
    for index in range(count):
        start = ((round_index * 37 + index) * 211) % span
        jobs.append(prompts.map_messages(tokenizer.decode(ids[start : start + doc_tokens])))
    return jobs


def run_once(llm, jobs: list, concurrency: int, max_tokens: int) -> dict:
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = {key: llm.engine.stats()[key] for key in SPEC_KEYS}
    started = time.perf_counter()
    if concurrency == 1:
        outputs = [llm.chat([job], params, use_tqdm=False)[0] for job in jobs]
    else:
        outputs = llm.chat(jobs, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    after = llm.engine.stats()
    drafts, drafted, accepted = (after[key] - before[key] for key in SPEC_KEYS)
    tokens = sum(len(o.token_ids) for o in outputs)
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot]
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "e2e": tokens / elapsed,
        "decode": 1 / statistics.median(tpots) if tpots else None,
        "token_ids": [o.token_ids for o in outputs],
        "drafts": drafts,
        "drafted": drafted,
        "accepted": accepted,
    }


def measure(engines: dict, args, text: str) -> dict:
    results = {(c, mode): [] for c in args.concurrency for mode in MODES}
    tokenizer = engines["off"].tokenizer
    for round_index in range(args.rounds):
        for c in args.concurrency:
            jobs = make_jobs(tokenizer, text, 2 if c == 1 else c, round_index, args.doc_tokens)
            order = MODES if (round_index + c) % 2 == 0 else MODES[::-1]
            runs = {mode: run_once(engines[mode], jobs, c, args.max_tokens) for mode in order}
            assert runs["off"]["token_ids"] == runs["ngram"]["token_ids"], "greedy outputs must be identical"
            for mode in MODES:
                results[(c, mode)].append(runs[mode])
            print(
                f"round {round_index + 1}/{args.rounds} x{c:<2} "
                + "  ".join(
                    f"{mode}: {runs[mode]['e2e']:6.1f} tok/s e2e, {runs[mode]['decode'] or 0:6.1f} decoding"
                    for mode in MODES
                )
                + f"  accepted {_rate(runs['ngram']):.2f}",
                flush=True,
            )
    return results


def _rate(run: dict) -> float:
    return run["accepted"] / run["drafted"] if run["drafted"] else 0.0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def summarize(results: dict, args) -> list[dict]:
    rows = []
    for c in args.concurrency:
        off, spec = results[(c, "off")], results[(c, "ngram")]
        drafts = sum(r["drafts"] for r in spec)
        accepted, drafted = sum(r["accepted"] for r in spec), sum(r["drafted"] for r in spec)
        rows.append(
            {
                "concurrency": c,
                "off e2e tok/s": _spread([r["e2e"] for r in off]),
                "ngram e2e tok/s": _spread([r["e2e"] for r in spec]),
                "e2e ratio": _spread([s["e2e"] / o["e2e"] for s, o in zip(spec, off)]),
                "off decode tok/s": _spread([r["decode"] for r in off]),
                "ngram decode tok/s": _spread([r["decode"] for r in spec]),
                "decode ratio": _spread([s["decode"] / o["decode"] for s, o in zip(spec, off)]),
                "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                "tokens/drafting step": round(1 + accepted / drafts, 2) if drafts else 0.0,
            }
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--document", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    text = Path(args.document).read_text()
    engines = make_engines(args)
    warm = make_jobs(engines["off"].tokenizer, text, 2, 99, 64)
    for llm in engines.values():  # load, compile, first steps
        run_once(llm, warm, 2, 8)
    rows = summarize(measure(engines, args, text), args)
    print(f"\n{describe_cpu()}")
    print(
        f"{args.model} (quantization {args.quantization}), {args.doc_tokens}-token excerpts of {args.document}, "
        f"up to {args.max_tokens} summary tokens, greedy; {args.rounds} rounds; "
        f"speculative_config {args.speculative_config}"
    )
    print(format_table(rows, list(rows[0])))
    write_json(args.json, {"cpu": describe_cpu(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
