"""Online serving benchmark through the Redis front door, in the manner of ``vllm bench serve``.

    # against a running replica
    python benchmarks/serve.py --redis-url redis://127.0.0.1:6379 --request-rate 4
    # spawn an embedded Valkey + one `conveyor serve` replica with these engine flags
    python benchmarks/serve.py --spawn --engine-args "--batching dynamic --max-num-seqs 32"
    # sweep: one replica per policy (same build, workload, seed), every rate on each
    python benchmarks/serve.py --rates 1 2 4 8 --policies continuous dynamic --json serve.json --plot serve.png
    # prefix caching on vs off, summarization jobs sharing a 768-token instruction
    python benchmarks/serve.py --workload summarization --shared-prefix-tokens 768 --prefix-caching on off

Requests arrive as a Poisson process at ``--request-rate`` per second (gamma-distributed
gaps with ``--burstiness``: 1 is Poisson, lower is burstier, as vLLM), or all at once
(``inf``); ``--max-concurrency`` caps the requests in flight. Every request uses
``ignore_eos`` so lengths are fixed. Workloads: ``random`` (lengths uniform in
len x [1 - range, 1 + range]), ``mixed`` (benchmarks/offline.py's: prompts 32-256,
outputs 16-128), ``summarization`` (long prompts, short outputs, optionally all starting
with the same ``--shared-prefix-tokens`` instruction).

Per request, measured by this client: TTFT (first token event arrives - submit), ITL
(gaps between token events, a gap divided among the tokens its event carries), TPOT
((e2e - TTFT) / (output tokens - 1)), e2e (done event arrives - submit); and from the done
event's timings the engine's queue time. Reports request and token throughput, mean /
median / P99 of each latency, and goodput (requests/s meeting ``--slo-ttft`` and
``--slo-tpot``).
"""
import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (check_alive, embedded_valkey, format_table, random_prompt, spawned_replica,  # noqa: E402
                     summarize, vocab_size, write_json)
from offline import make_workload  # noqa: E402

WORKLOAD_LENGTHS = {"random": (128, 32), "summarization": (1024, 32)}  # default (input, output) tokens
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    token_events: int = 0
    queue: float | None = None  # engine side, from the done event
    engine_ttft: float | None = None  # engine side, from the done event
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.error or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- workloads -------------------------------------------------------------------------------
def build_workload(args, vocab: int, rate_index: int = 0) -> list[Request]:
    """The requests of the ``rate_index``-th rate of a sweep: the same for every variant, new
    for every rate, so a rate never finds the previous rate's prompts in the prefix cache
    (only the ``--shared-prefix-tokens`` are common to all)."""
    seed = args.seed + 1000 * rate_index
    if args.workload == "mixed":
        prompts, output_lens = make_workload(args.num_prompts, vocab, seed)
        return [Request(p, n) for p, n in zip(prompts, output_lens)]
    input_len, output_len = _lengths(args)
    prefix = random_prompt(random.Random(args.seed), args.shared_prefix_tokens, vocab)
    rng = random.Random(seed)
    return [Request(prefix + random_prompt(rng, _around(rng, input_len, args.range_ratio), vocab),
                    _around(rng, output_len, args.range_ratio)) for _ in range(args.num_prompts)]


def _lengths(args) -> tuple[int, int]:
    input_len, output_len = WORKLOAD_LENGTHS[args.workload]
    return args.input_len or input_len, args.output_len or output_len


def _around(rng: random.Random, length: int, range_ratio: float) -> int:
    return max(1, rng.randint(int(length * (1 - range_ratio)), int(length * (1 + range_ratio))))


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent; gamma gaps of mean 1 / rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed + 1)
    gaps = [rng.gammavariate(burstiness, 1 / (rate * burstiness)) for _ in range(count - 1)]
    offsets = [0.0]
    for gap in gaps:
        offsets.append(offsets[-1] + gap)
    return offsets


# ---- one request -----------------------------------------------------------------------------
async def send_request(client, request: Request, args) -> RequestRecord:
    from clients import ConveyorError
    record = RequestRecord(len(request.prompt_token_ids))
    submitted = time.perf_counter()
    try:
        job = await client.submit(prompt_token_ids=request.prompt_token_ids, max_tokens=request.max_tokens,
                                  ignore_eos=True, temperature=0, priority_class=args.priority_class)
        last = None
        async for event in job.stream(timeout=args.request_timeout):
            last = _record_token_event(record, event, submitted, last)
        result = await job.result()
        record.e2e = time.perf_counter() - submitted
        record.ttft = record.e2e if record.ttft is None else record.ttft  # every token came with `done`
        record.output_tokens = len(result.token_ids)
        record.queue, record.engine_ttft = result.timings.queue, result.timings.ttft
    except ConveyorError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _record_token_event(record: RequestRecord, event, submitted: float, last: float | None) -> float:
    """TTFT on the first event; later events add one ITL sample per token they carry."""
    now = time.perf_counter()
    record.token_events += 1
    if last is None:
        record.ttft = now - submitted
    elif event.token_ids:
        gap = (now - last) / len(event.token_ids)
        record.itl.extend([gap] * len(event.token_ids))
    else:
        return last  # no tokens: not a gap
    return now


# ---- one run: a workload at one rate against one replica -------------------------------------
async def run_benchmark(redis_url: str, requests: list[Request], rate: float, args, replica=None,
                        label: str = "") -> dict:
    from clients import AsyncClient
    from tqdm import tqdm
    async with AsyncClient(redis_url, args.namespace) as client:
        await wait_until_ready(client, replica)
        offsets = arrival_offsets(len(requests), rate, args.burstiness, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests))
        with tqdm(total=len(requests), desc=label or f"rate {rate}", unit="req") as bar:
            start = time.perf_counter()
            records = await asyncio.gather(*(_send_at(client, r, start + o, limit, bar, args)
                                             for r, o in zip(requests, offsets)))
            duration = time.perf_counter() - start
    return {"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            **summarize_run(records, duration, args), "requests": [_record_json(r) for r in records]}


async def _send_at(client, request: Request, send_time: float, limit: asyncio.Semaphore, bar, args):
    await asyncio.sleep(max(0.0, send_time - time.perf_counter()))
    async with limit:
        record = await send_request(client, request, args)
    bar.update(1)
    return record


async def wait_until_ready(client, replica, timeout: float = 600.0) -> None:
    """One tiny job, answered: the replica is up and its model warm. A first start may
    take minutes (GGUF conversion, kernel build)."""
    from clients import Timeout
    job = await client.submit(prompt_token_ids=[100, 101, 102, 103], max_tokens=4, temperature=0)
    deadline = time.monotonic() + timeout
    while True:
        check_alive(replica)
        try:
            await job.result(timeout=5)
            return
        except Timeout:
            if time.monotonic() > deadline:
                raise


def summarize_run(records: list[RequestRecord], duration: float, args) -> dict:
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in done)
    latencies = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
                 "itl": [gap for r in done for gap in r.itl], "e2e": [r.e2e for r in done],
                 "queue": [r.queue for r in done if r.queue is not None]}
    return {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
            "request_throughput": len(done) / duration, "output_tokens_per_s": output_tokens / duration,
            "total_tokens_per_s": total_tokens / duration, "output_tokens": output_tokens,
            "goodput": sum(meets_slo(r, args) for r in done) / duration,
            **{name: summarize(values) for name, values in latencies.items()},
            "errors": sorted({r.error for r in records if r.error})[:5]}


def meets_slo(record: RequestRecord, args) -> bool:
    ttft_ok = args.slo_ttft is None or record.ttft <= args.slo_ttft
    tpot_ok = args.slo_tpot is None or record.tpot is None or record.tpot <= args.slo_tpot
    return ttft_ok and tpot_ok


def _record_json(record: RequestRecord) -> dict:
    return {**{k: v for k, v in asdict(record).items() if k != "itl"}, "tpot": record.tpot}


# ---- replicas and sweeps ---------------------------------------------------------------------
@contextlib.contextmanager
def replica_for(args, variant_args: str):
    """(redis_url, replica process or None): the running replica at --redis-url, or one
    spawned on --redis-url if given, else on a fresh embedded Valkey."""
    if not args.spawn:
        yield args.redis_url, None
        return
    engine_args = f"{args.engine_args} {variant_args}".strip()
    server = contextlib.nullcontext(args.redis_url) if args.redis_url else embedded_valkey()
    with server as url, spawned_replica(args.model, url, engine_args, args.replica_log) as replica:
        yield url, replica


def run_sweep(args, workloads: list[list[Request]]) -> list[dict]:
    """``workloads[i]``: the requests of rate ``args.rates[i]``."""
    runs = []
    for variant, variant_args in engine_variants(args):
        with replica_for(args, variant_args) as (url, replica):
            for rate, requests in zip(args.rates, workloads):
                run = asyncio.run(run_benchmark(url, requests, rate, args, replica, f"{variant} rate {rate:g}/s"))
                runs.append({"variant": variant, **run})
                print(describe_run(runs[-1], args), flush=True)
    return runs


def engine_variants(args) -> list[tuple[str, str]]:
    """(label, extra `conveyor serve` flags): one replica per batching policy x prefix-cache
    setting swept; a single ("as configured", "") when nothing is swept."""
    variants = []
    for policy in args.policies or [None]:
        for caching in args.prefix_caching or [None]:
            label = ", ".join(part for part in (policy, caching and f"prefix cache {caching}") if part)
            flags = " ".join(flag for flag in (policy and f"--batching {policy}",
                                               caching and f"--enable-prefix-caching {caching == 'on'}") if flag)
            variants.append((label or "as configured", flags))
    return variants


def describe_run(run: dict, args) -> str:
    lines = [f"== {run['variant']}, request rate {run['request_rate']:g}/s, "
             f"max concurrency {run['max_concurrency'] or '-'} ==",
             f"completed {run['completed']}, failed {run['failed']}, {run['duration_s']:.1f} s",
             f"request throughput {run['request_throughput']:.2f} req/s, output {run['output_tokens_per_s']:.1f} "
             f"tok/s, total {run['total_tokens_per_s']:.1f} tok/s",
             f"goodput {run['goodput']:.2f} req/s ({describe_slo(args)})"]
    for name in LATENCIES:
        stats = run[name]
        if stats["mean"] is not None:
            lines.append(f"  {name:>5} ms: mean {1000 * stats['mean']:8.1f}  median {1000 * stats['p50']:8.1f}  "
                         f"p99 {1000 * stats['p99']:8.1f}")
    lines += [f"  error: {error}" for error in run["errors"]]
    return "\n".join(lines)


def describe_slo(args) -> str:
    slos = [f"{name} <= {value} s" for name, value in (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot))
            if value is not None]
    return " and ".join(slos) if slos else "no SLO given: every completed request counts"


def sweep_table(runs: list[dict]) -> str:
    rows = [{"variant": r["variant"], "rate": r["request_rate"], "req/s": r["request_throughput"],
             "out tok/s": r["output_tokens_per_s"], "goodput": r["goodput"],
             **{f"{name} {stat} ms": _ms(r[name][stat]) for name in ("ttft", "tpot", "e2e")
                for stat in ("p50", "p99")}, "failed": r["failed"]} for r in runs]
    return format_table(rows, list(rows[0]))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def plot_sweep(runs: list[dict], path: str) -> None:
    """TTFT and e2e (median solid, P99 dashed) and output tokens/s vs request rate, a line per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    finite = [r for r in runs if math.isfinite(r["request_rate"])]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for color, variant in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], _unique(r["variant"] for r in finite)):
        mine = [r for r in finite if r["variant"] == variant]
        rates = [r["request_rate"] for r in mine]
        for axis, metric in zip(axes, ("ttft", "e2e")):
            axis.plot(rates, [_ms(r[metric]["p50"]) for r in mine], "o-", color=color, label=f"{variant} median")
            axis.plot(rates, [_ms(r[metric]["p99"]) for r in mine], "s--", color=color, label=f"{variant} P99")
        axes[2].plot(rates, [r["output_tokens_per_s"] for r in mine], "o-", color=color, label=variant)
    for axis, title in zip(axes, ("TTFT (ms)", "end-to-end latency (ms)", "output tokens/s")):
        axis.set(xlabel="request rate (req/s)", title=title)
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}" + ("" if len(finite) == len(runs) else " (infinite rates left out)"))


def _unique(values) -> list:
    return list(dict.fromkeys(values))


# ---- command line ----------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("target")
    target.add_argument("--redis-url", help="the Redis of a running replica; with --spawn, where to spawn one")
    target.add_argument("--namespace", default=None)
    target.add_argument("--spawn", action="store_true",
                        help="start a replica per swept variant, on an embedded Valkey unless --redis-url "
                             "(the default when no --redis-url is given)")
    target.add_argument("--model", default="smollm2")
    target.add_argument("--engine-args", default="",
                        help='flags for the spawned conveyor serve, e.g. --engine-args="--max-num-seqs 32"')
    target.add_argument("--replica-log", help="append the spawned replica's output here (default: this terminal)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    load.add_argument("--rates", type=float, nargs="+", help="sweep these request rates")
    load.add_argument("--policies", nargs="+", choices=["continuous", "dynamic"], help="sweep these (implies --spawn)")
    load.add_argument("--prefix-caching", nargs="+", choices=["on", "off"],
                      help="sweep prefix caching on/off (implies --spawn)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--priority-class", default="interactive", choices=["interactive", "batch"])
    load.add_argument("--request-timeout", type=float, default=600.0, help="longest wait for a request's next event")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", default="random", choices=["random", "mixed", "summarization"])
    workload.add_argument("--num-prompts", type=int, default=30)
    workload.add_argument("--input-len", type=int, help="random: 128, summarization: 1024 (mixed: fixed ranges)")
    workload.add_argument("--output-len", type=int, help="random: 32, summarization: 32")
    workload.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len x [1-r, 1+r]")
    workload.add_argument("--shared-prefix-tokens", type=int, default=0, help="same leading tokens in every prompt")
    workload.add_argument("--seed", type=int, default=0)
    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    report.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    report.add_argument("--json", metavar="PATH")
    report.add_argument("--plot", metavar="PATH", help="PNG of latency and throughput vs rate (sweeps)")
    args = parser.parse_args(argv)
    args.spawn = args.spawn or bool(args.policies) or bool(args.prefix_caching) or not args.redis_url
    args.rates = args.rates or [args.request_rate]
    return args


def main(argv=None):
    args = parse_args(argv)
    workloads = [build_workload(args, vocab_size(args.model), i) for i in range(len(args.rates))]
    runs = run_sweep(args, workloads)
    if len(runs) > 1:
        print("\n" + sweep_table(runs))
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    write_json(args.json, {"settings": settings, "workload": describe_workload(workloads[0]), "runs": runs})
    if args.plot:
        plot_sweep(runs, args.plot)


def describe_workload(requests: list[Request]) -> dict:
    return {"requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests)}


if __name__ == "__main__":
    main()
