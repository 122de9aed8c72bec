"""The offline workload through Redis + actors vs the offline ``LLM``, alternating rounds.

    python benchmarks/queue_vs_offline.py [--model smollm2] [--num-requests 32] [--rounds 3]
                                          [--modes offline,queue,queue_overlapped,queue_thread]

``queue_traced`` (not in the default modes) is ``queue`` with OpenTelemetry tracing on,
exporting every job's spans over OTLP/HTTP to a sink in this process (docs/tracing.md):
what tracing costs; plain ``queue`` has none configured.

One embedded Valkey and one ``conveyor serve`` replica per queue mode (separate processes,
as in production): ``queue`` is the default replica (its engine core in a process of its
own, one step at a time), ``queue_overlapped`` the same with ``--async-scheduling true``
(the core runs the model on a thread and applies step N while N+1 runs), ``queue_thread``
the engine on a thread of the replica's own process (``--engine-process false``, steps
overlapped: the default before the core had its own process). The offline LLM runs in
this process. Each round draws new
prompts (so no prefix cache helps across rounds), runs every mode on them in a rotating
order, and counts output tokens/s from the first submission to the last result. Prints the
median and spread of each mode and of queue / offline (target: >= 0.95).
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, embedded_valkey, otlp_sink, spawned_replica, write_json  # noqa: E402
from offline import make_workload  # noqa: E402

ENGINE_OPTIONS = dict(max_num_seqs=64, max_num_batched_tokens=512)
QUEUE_MODES = {
    "queue": [],
    "queue_overlapped": ["--async-scheduling", "true"],
    "queue_thread": ["--engine-process", "false"],
    "queue_traced": [],
}
TRACED_MODES = {"queue_traced"}


def offline_runner(model: str):
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, **ENGINE_OPTIONS)

    def run(prompts, output_lens) -> int:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        return sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))

    return run


def queue_runner(redis_url: str, namespace: str):
    from conveyor.clients import Client

    client = Client(redis_url, namespace=namespace)

    def run(prompts, output_lens) -> int:
        jobs = client.submit_many(
            [
                {"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True, "temperature": 0}
                for p, n in zip(prompts, output_lens)
            ],
            progress=False,
        )
        return sum(len(job.result(timeout=1800).token_ids) for job in jobs)

    return run


def measure(runners: dict, args, vocab: int) -> dict[str, list[float]]:
    rates = {mode: [] for mode in runners}
    order = list(runners)
    for round_index in range(args.rounds):
        prompts, output_lens = make_workload(args.num_requests, vocab, seed=100 + round_index)
        for mode in order[round_index % len(order) :] + order[: round_index % len(order)]:
            start = time.perf_counter()
            tokens = runners[mode](prompts, output_lens)
            elapsed = time.perf_counter() - start
            assert tokens == sum(output_lens), f"{mode}: ignore_eos outputs must have exactly max_tokens tokens"
            rates[mode].append(tokens / elapsed)
            print(
                f"round {round_index + 1}/{args.rounds} {mode:>17}: {tokens / elapsed:7.1f} output tok/s "
                f"({elapsed:.1f} s)",
                flush=True,
            )
    return rates


def report(rates: dict[str, list[float]], args) -> dict:
    print(f"\n{describe_cpu()}\nworkload: {args.num_requests} requests x {args.rounds} rounds, {args.model}")
    summary = {}
    for mode, values in rates.items():
        summary[mode] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(
            f"  {mode:>17}: {summary[mode]['median']:7.1f} output tok/s (min {min(values):.1f}, max {max(values):.1f})"
        )
    if "offline" in rates:
        for mode in QUEUE_MODES:
            if mode in rates:
                ratios = [q / o for q, o in zip(rates[mode], rates["offline"])]  # same round, same prompts
                summary[f"{mode}/offline"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
                print(
                    f"  {mode} / offline = {statistics.median(ratios):.2f} "
                    f"(per round {min(ratios):.2f}-{max(ratios):.2f})"
                )
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="offline,queue,queue_overlapped,queue_thread")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    from conveyor.engine.models.loader import load_spec

    vocab = load_spec(args.model).hf_config.vocab_size
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
    with embedded_valkey() as url, otlp_sink() as sink:
        traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink, "OTEL_SERVICE_NAME": "bench-replica"}
        runners, replicas = {}, []
        for mode in modes:
            if mode == "offline":
                runners[mode] = offline_runner(args.model)
            else:
                namespace = f"bench-{mode.replace('_', '-')}"
                replica = spawned_replica(
                    args.model,
                    url,
                    [*flags, *QUEUE_MODES[mode], "--namespace", namespace],
                    env=traced if mode in TRACED_MODES else {"OTEL_EXPORTER_OTLP_ENDPOINT": ""},
                )
                replicas.append(replica)
                replica.__enter__()
                runners[mode] = queue_runner(url, namespace)
        try:
            warm = make_workload(2, vocab, seed=random.randrange(1 << 30))
            for runner in runners.values():  # load, first compile, first steps
                runner(*warm)
            summary = report(measure(runners, args, vocab), args)
        finally:
            for replica in replicas:
                replica.__exit__(None, None, None)
    write_json(args.json, {"cpu": describe_cpu(), "summary": summary})


if __name__ == "__main__":
    main()
