"""An interactive job's time to first token while long batch-class prompts are being
prefilled (issue 39 item 13), with the prompt-chunk cap (long_prefill_token_threshold, default
half the step budget) and without it (0: a running prefill takes the whole budget, as before).

The engine is driven step by step in this process (the replica's engine core runs the same
LLMEngine): DOCS batch-class prompts of DOC_TOKENS tokens each are added, the first steps of
their prefill run, then one short interactive chat arrives; its TTFT and the batch prompts'
total time are measured. Rounds alternate the two settings.

    .venv/bin/python benchmarks/prefill_fairness.py --rounds 3
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, write_json  # noqa: E402

from conveyor.engine import LLMEngine, SamplingParams  # noqa: E402
from conveyor.engine.config import EngineConfig  # noqa: E402


def one_round(engine: LLMEngine, doc_ids: list[list[int]], steps_before: int) -> dict:
    started = time.perf_counter()
    for index, ids in enumerate(doc_ids):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.add_request(f"doc-{index}-{started}", ids, params, priority_class="batch")
    for _ in range(steps_before):
        engine.step()
    arrived = time.perf_counter()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    engine.add_request(f"chat-{started}", None, SamplingParams(temperature=0, max_tokens=8), messages=question)
    ttft = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith("chat-") and ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - arrived
    return {"ttft_s": ttft, "total_s": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--docs", type=int, default=2, help="batch-class prompts prefilled at once")
    parser.add_argument("--doc-tokens", type=int, default=1536)
    parser.add_argument("--steps-before", type=int, default=2, help="prefill steps before the chat arrives")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    engines = {
        name: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, long_prefill_token_threshold=threshold))
        for name, threshold in (("capped", None), ("uncapped", 0))
    }
    tokenizer = engines["capped"].tokenizer
    text = " ".join(f"Section {i}: the queue holds jobs that replicas take in turn." for i in range(2000))
    ids = tokenizer.encode(text)[: args.doc_tokens]

    def fresh_docs(round_index: int) -> list[list[int]]:  # nothing the prefix cache holds from another round
        shift = 1 + round_index * args.docs
        return [[(token + shift + index) % len(tokenizer) for token in ids] for index in range(args.docs)]

    for engine in engines.values():  # compiled kernels, caches and allocations warm before timing
        one_round(engine, [ids[:256]], 0)
    runs = 0
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name in sorted(engines, reverse=round_index % 2 == 1):  # alternate which goes first
            runs += 1
            result = one_round(engines[name], fresh_docs(runs), args.steps_before)
            results[name].append(result)
            print(f"round {round_index + 1} {name}: TTFT {result['ttft_s']:.2f} s, all done {result['total_s']:.1f} s")
    summary = {
        name: {key: statistics.median(r[key] for r in rows) for key in ("ttft_s", "total_s")}
        for name, rows in results.items()
    }
    ratios = [u["ttft_s"] / c["ttft_s"] for u, c in zip(results["uncapped"], results["capped"])]
    print(
        f"median TTFT: capped {summary['capped']['ttft_s']:.2f} s, uncapped {summary['uncapped']['ttft_s']:.2f} s "
        f"(uncapped/capped per round: {', '.join(f'{r:.1f}' for r in ratios)}); batch work done in "
        f"{summary['capped']['total_s']:.1f} vs {summary['uncapped']['total_s']:.1f} s"
    )
    write_json(args.json, {"cpu": describe_cpu(), "args": vars(args), "rounds": results, "median": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
