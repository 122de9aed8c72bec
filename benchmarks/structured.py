"""Structured-output overhead per token: JSON-schema-constrained vs unconstrained decoding of
the same prompts, alternating rounds in one run.

    python benchmarks/structured.py [--model smollm2] [--rounds 5] [--tokens 64] [--json out.json]

Each round runs, at batch 1 and at batch 8, the same chat prompts twice: constrained by a
JSON schema that cannot end before ``--tokens`` tokens (an array with many required
records, so every request stops at max_tokens, ``length``), and unconstrained with
ignore_eos (the same number of tokens). The two alternate, their order flipped every
round. A request's decode time is from its first token to its last (prefill left out), per
output token of the batch. The grammar work is also timed directly: the runner's bitmask
pass (fill + mask) and its accept step, per constrained row.

Prints the CPU and its ISA, the median and range (min-max) of each, the ratio of the
medians and the difference per token. The machine may be shared: read the spread first.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_json_option, describe_cpu, format_table, write_json  # noqa: E402

RECORDS = {
    "type": "array",
    "minItems": 60,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Berlin", "Rome", "Madrid"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
TOPICS = ["engineers", "teachers", "painters", "doctors", "pilots", "chefs", "writers", "farmers"]
MODES = ("constrained", "unconstrained")
COLUMNS = (
    "batch",
    "clock",
    "mode",
    "median ms/token",
    "min",
    "max",
    "vs unconstrained",
    "+ms/token",
    "apply us/row",
    "accept us/row",
    "timed share",
)


class GrammarTimer:
    """Wraps the runner's GrammarMasks to add up the seconds of its two calls and the rows."""

    def __init__(self, masks):
        self.seconds = {"apply": 0.0, "accept": 0.0}
        self.rows = 0
        for name in self.seconds:
            setattr(masks, name, self._timed(name, getattr(masks, name)))

    def _timed(self, name, call):
        def timed(*args):
            start = time.perf_counter()
            result = call(*args)
            self.seconds[name] += time.perf_counter() - start
            if name == "apply":
                self.rows += len(result)
            return result

        return timed

    def reset(self):
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.rows = 0


def params_for(mode: str, tokens: int):
    from conveyor.engine import SamplingParams, StructuredOutputsParams

    if mode == "constrained":
        constraint = StructuredOutputsParams(json=RECORDS)
        return SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=constraint)
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def one_round(llm, mode: str, batch: int, tokens: int) -> dict:
    """Seconds per output token of the batch: wall clock while decoding (first token to last),
    and CPU seconds of this process over the whole call (prefill included; on a shared box it
    does not count the time other processes took the cores)."""
    chats = [[{"role": "user", "content": f"List some {topic} as JSON records."}] for topic in TOPICS[:batch]]
    cpu = time.process_time()
    outputs = llm.chat(chats, params_for(mode, tokens), use_tqdm=False)
    cpu = time.process_time() - cpu
    assert all(len(o.token_ids) == tokens and o.finish_reason == "length" for o in outputs), [
        (o.finish_reason, len(o.token_ids), o.error) for o in outputs
    ]
    first = max(o.timestamps.first_token for o in outputs)
    last = max(o.timestamps.finished for o in outputs)
    return {"wall": (last - first) / ((tokens - 1) * batch), "cpu": cpu / (tokens * batch)}


def table_rows(batch: int, results: dict, grammar: list[dict]) -> list[dict]:
    rows = []
    for clock in ("wall", "cpu"):
        medians = {mode: statistics.median(r[clock] for r in results[mode]) for mode in MODES}
        for mode in MODES:
            values = [r[clock] for r in results[mode]]
            rows.append(
                {
                    "batch": batch,
                    "clock": clock,
                    "mode": mode,
                    "median ms/token": 1e3 * medians[mode],
                    "min": 1e3 * min(values),
                    "max": 1e3 * max(values),
                    "vs unconstrained": medians[mode] / medians["unconstrained"],
                }
            )
        rows[-2]["+ms/token"] = 1e3 * (medians["constrained"] - medians["unconstrained"])
    for name in ("apply", "accept"):
        rows[0][f"{name} us/row"] = 1e6 * statistics.median(g[name] for g in grammar)
    wall = statistics.median(r["wall"] for r in results["unconstrained"])
    rows[0]["timed share"] = statistics.median(g["apply"] + g["accept"] for g in grammar) / wall
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_json_option(parser)
    args = parser.parse_args()
    import torch

    from conveyor.engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_cpu(), f"| torch threads: {torch.get_num_threads()}")
    llm = LLM(args.model, dtype="float32", device="cpu", kv_cache_memory="256MiB", max_num_seqs=max(args.batches))
    timer = GrammarTimer(llm.engine.runner.grammar_masks)
    for mode in MODES:  # warm-up; also compiles the schema (it is cached from then on)
        one_round(llm, mode, 1, 8)
    results = {batch: {mode: [] for mode in MODES} for batch in args.batches}
    grammar = {batch: [] for batch in args.batches}
    for number in range(args.rounds):
        for batch in args.batches:
            for mode in MODES if number % 2 == 0 else MODES[::-1]:
                timer.reset()
                results[batch][mode].append(one_round(llm, mode, batch, args.tokens))
                if mode == "constrained":
                    grammar[batch].append({name: s / timer.rows for name, s in timer.seconds.items()})
    rows = [row for batch in args.batches for row in table_rows(batch, results[batch], grammar[batch])]
    print(
        f"\n{args.rounds} alternating rounds of {args.tokens} output tokens per request, greedy, {args.model} "
        f"float32; ms per output token of the batch"
    )
    print(format_table(rows, COLUMNS))
    print(
        "wall: decoding, first token to last; cpu: this process's CPU time over the whole call (prefill too);\n"
        "apply: the bitmask pass (fill the rows, mask the logits); accept: check and advance each matcher;\n"
        "timed share: apply + accept per row (= per output token) over the unconstrained wall time per token"
    )
    write_json(args.json, {"settings": vars(args), "cpu": describe_cpu(), "results": results, "grammar": grammar})


if __name__ == "__main__":
    main()
