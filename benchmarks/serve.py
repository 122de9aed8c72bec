"""Online serving benchmark through the Redis front door or the HTTP gateway, in the manner
of ``vllm bench serve``.

    # against a running replica
    python benchmarks/serve.py --redis-url redis://127.0.0.1:6379 --request-rate 4
    # the gateway's cost: queue and HTTP alternating on one spawned replica (+ spawned gateway)
    python benchmarks/serve.py --spawn --mode both --rounds 2 --request-rate 4 --num-prompts 48
    # through a running gateway only, as vllm bench serve drives an OpenAI server
    python benchmarks/serve.py --mode http --gateway-url http://127.0.0.1:8000 --request-rate 4
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

``--mode`` picks the path: ``queue`` (default) submits through clients.AsyncClient;
``http`` sends streaming ``POST /v1/completions`` to a gateway with httpx (one connection
pool, a connection per request in flight): ``prompt`` as token ids (``--prompt-format
text``: their decoded text), ``max_tokens``, ``ignore_eos``, ``temperature`` 0, ``stream``
with ``include_usage``. There TTFT is the first SSE chunk with text, ITL the gaps between
text chunks (the gateway sends one per token event, as vLLM counts chunks), e2e the
``[DONE]`` line, output tokens from the usage chunk; the engine's queue time is not in
the stream. The gateway is ``--gateway-url``, else one ``conveyor gateway`` spawned on a
free loopback port against the replica's Redis. ``both`` runs the two on the same replica,
workload and arrival times, alternating ``--rounds`` times (queue, http, queue, http...;
``--order abba`` reverses every second round, which cancels a steady drift of the
machine), and prints gateway/queue ratios with their spread over rounds. Every run has fresh prompt
tokens of the same lengths (the prefix cache never serves one run from another's), and
``--warmup`` requests through each path come first (default: 4 in http/both modes, none
in queue mode). Each run also reports the CPU seconds of the replica, the gateway and this
client: on a small machine they compete for the same cores.
"""

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    check_alive,
    cpu_info,
    cpu_seconds,
    describe_cpu,
    embedded_valkey,
    format_table,
    random_prompt,
    spawned_gateway,
    spawned_replica,
    summarize,
    vocab_size,
    write_json,
)
from offline import make_workload  # noqa: E402

WORKLOAD_LENGTHS = {"random": (128, 32), "summarization": (1024, 32)}  # default (input, output) tokens
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")
MODES = {"queue": ("queue",), "http": ("http",), "both": ("queue", "http")}
MODE_NAMES = {"queue": "queue (AsyncClient)", "http": "http (gateway)"}
TARGET_COST_PERCENT = 10.0  # the gateway's budget: TTFT and output throughput within 10% of the queue's


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # --prompt-format text: the decoded prompt (re-tokenized by the replica)


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
def build_workload(args, vocab: int, rate_index: int = 0, content_index: int = 0, tokenizer=None) -> list[Request]:
    """The requests of the ``rate_index``-th rate of a sweep: the same for every variant, new
    for every rate, so a rate never finds the previous rate's prompts in the prefix cache
    (only the ``--shared-prefix-tokens`` are common to all).

    ``content_index`` > 0 keeps every length (the same work for the engine) but draws new
    prompt tokens after the shared prefix: the runs of one rate (rounds, queue and http)
    each get their own, so none is served from another's prefix cache. With a
    ``tokenizer`` each request also gets its prompt as text."""
    seed = args.seed + 1000 * rate_index
    if args.workload == "mixed":
        prompts, output_lens = make_workload(args.num_prompts, vocab, seed)
        requests, prefix_len = [Request(p, n) for p, n in zip(prompts, output_lens)], 0
    else:
        input_len, output_len = _lengths(args)
        prefix = random_prompt(random.Random(args.seed), args.shared_prefix_tokens, vocab)
        rng = random.Random(seed)
        requests = [
            Request(
                prefix + random_prompt(rng, _around(rng, input_len, args.range_ratio), vocab),
                _around(rng, output_len, args.range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
        prefix_len = len(prefix)
    if content_index:
        rng = random.Random(f"{seed}/{content_index}")
        for request in requests:
            tail = len(request.prompt_token_ids) - prefix_len
            request.prompt_token_ids = request.prompt_token_ids[:prefix_len] + random_prompt(rng, tail, vocab)
    if tokenizer is not None:
        for request in requests:
            request.prompt_text = tokenizer.decode(request.prompt_token_ids)
    return requests


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
    from conveyor.clients import ConveyorError

    record = RequestRecord(len(request.prompt_token_ids))
    prompt = (
        {"prompt": request.prompt_text}
        if request.prompt_text is not None
        else {"prompt_token_ids": request.prompt_token_ids}
    )
    submitted = time.perf_counter()
    try:
        job = await client.submit(
            **prompt, max_tokens=request.max_tokens, ignore_eos=True, temperature=0, priority_class=args.priority_class
        )
        last = None
        async for event in job.stream(timeout=args.request_timeout):
            last = _record_token_event(record, event, submitted, last)
        result = await job.result()
        record.e2e = time.perf_counter() - submitted
        record.ttft = record.e2e if record.ttft is None else record.ttft  # every token came with `done`
        record.output_tokens = len(result.token_ids)
        record.prompt_tokens = result.usage.prompt_tokens or record.prompt_tokens
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


def completion_body(request: Request, model: str) -> dict:
    """What ``vllm bench serve`` sends an OpenAI server (its openai-completions backend)."""
    prompt = request.prompt_text if request.prompt_text is not None else request.prompt_token_ids
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_http_request(client, model: str, request: Request, args) -> RequestRecord:
    """One streaming /v1/completions: TTFT at the first chunk with text, an ITL sample per
    later text chunk, e2e at ``data: [DONE]``, token counts from the usage chunk."""
    import httpx

    record = RequestRecord(len(request.prompt_token_ids))
    headers = {"X-Conveyor-Priority-Class": args.priority_class}
    submitted = time.perf_counter()
    try:
        async with client.stream(
            "POST", "/v1/completions", json=completion_body(request, model), headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            last = None
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    record.error = f"stream error: {error.get('message') if isinstance(error, dict) else error}"
                    return record
                choices = chunk.get("choices")
                if choices and choices[0].get("text"):
                    record.token_events += 1
                    if last is None:
                        record.ttft = now - submitted
                    else:
                        record.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"] or record.prompt_tokens
        record.e2e = time.perf_counter() - submitted
        record.ttft = record.e2e if record.ttft is None else record.ttft
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


# ---- one run: a workload at one rate against one replica -------------------------------------
@dataclass
class Target:
    """Where a run's requests go, and the processes whose CPU time it reports."""

    redis_url: str | None
    replica: object = None  # the spawned `conveyor serve` (Popen), else None
    gateway_url: str | None = None
    gateway: object = None  # the spawned `conveyor gateway` (Popen), else None
    model: str | None = None  # the model name the gateway serves (found on the first http run)


async def run_benchmark(
    target: Target,
    requests: list[Request],
    rate: float,
    args,
    label: str = "",
    mode: str = "queue",
    warmup: bool = False,
) -> dict:
    """One run: ``requests`` at ``rate`` through the queue or the gateway (``mode``)."""
    if mode == "http":
        return await _run_http(target, requests, rate, args, label, warmup)
    from conveyor.clients import AsyncClient

    async with AsyncClient(target.redis_url, args.namespace) as client:
        await wait_until_ready(client, target.replica)
        return await _drive(requests, rate, args, label, lambda r: send_request(client, r, args), target, warmup)


async def _run_http(target: Target, requests: list[Request], rate: float, args, label: str, warmup: bool) -> dict:
    import httpx

    connections = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=target.gateway_url, limits=limits, timeout=timeout) as client:
        target.model = await wait_until_served(client, target, args)
        return await _drive(
            requests, rate, args, label, lambda r: send_http_request(client, target.model, r, args), target, warmup
        )


async def _drive(
    requests: list[Request], rate: float, args, label: str, send, target: Target, warmup: bool = False
) -> dict:
    """Sends ``requests`` at their arrival times (a warm-up: all at once) through ``send``."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), math.inf if warmup else rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    cpu_before = _cpu_now(target)
    with tqdm(total=len(requests), desc=label or f"rate {rate}", unit="req") as bar:
        start = time.perf_counter()
        records = await asyncio.gather(*(_send_at(send, r, start + o, limit, bar) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    cpu = {
        name: None if after is None or cpu_before[name] is None else after - cpu_before[name]
        for name, after in _cpu_now(target).items()
    }
    return {
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summarize_run(records, duration, args),
        "cpu_s": cpu,
        "requests": [_record_json(r) for r in records],
    }


def _cpu_now(target: Target) -> dict:
    """CPU seconds so far of the replica, the gateway (spawned ones only) and this client."""
    return {
        "replica": target.replica and cpu_seconds(target.replica.pid),
        "gateway": target.gateway and cpu_seconds(target.gateway.pid),
        "client": time.process_time(),
    }


async def _send_at(send, request: Request, send_time: float, limit: asyncio.Semaphore, bar):
    await asyncio.sleep(max(0.0, send_time - time.perf_counter()))
    async with limit:
        record = await send(request)
    bar.update(1)
    return record


async def wait_until_ready(client, replica, timeout: float = 600.0) -> None:
    """One tiny job, answered: the replica is up and its model warm. A first start may
    take minutes (GGUF conversion, kernel build)."""
    from conveyor.clients import Timeout

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


async def wait_until_served(client, target: Target, args, timeout: float = 600.0) -> str:
    """The gateway lists a live model (the replica announced itself) and answers a tiny
    completion for it; returns the model's name (the one matching --model's basename when
    several are served)."""
    deadline = time.monotonic() + timeout
    while True:
        check_alive(target.replica)
        check_alive(target.gateway, "gateway")
        reply = await client.get("/v1/models")
        names = [model["id"] for model in reply.json().get("data", [])] if reply.status_code == 200 else []
        if names:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the gateway at {target.gateway_url} served no model after {timeout:.0f} s "
                f"(/v1/models: {reply.status_code} {reply.text[:200]})"
            )
        await asyncio.sleep(0.5)
    wanted = Path(args.model).name
    if len(names) > 1 and wanted not in names:
        raise RuntimeError(f"the gateway serves several models {names}, none named {wanted!r}")
    model = wanted if wanted in names else names[0]
    probe = await send_http_request(client, model, Request([100, 101, 102, 103], 4), args)
    if probe.error:
        raise RuntimeError(f"the gateway's test completion failed: {probe.error}")
    return model


def summarize_run(records: list[RequestRecord], duration: float, args) -> dict:
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in done)
    latencies = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done],
        "queue": [r.queue for r in done if r.queue is not None],
    }
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": total_tokens / duration,
        "output_tokens": output_tokens,
        "goodput": sum(meets_slo(r, args) for r in done) / duration,
        **{name: summarize(values) for name, values in latencies.items()},
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def meets_slo(record: RequestRecord, args) -> bool:
    ttft_ok = args.slo_ttft is None or record.ttft <= args.slo_ttft
    tpot_ok = args.slo_tpot is None or record.tpot is None or record.tpot <= args.slo_tpot
    return ttft_ok and tpot_ok


def _record_json(record: RequestRecord) -> dict:
    return {**{k: v for k, v in asdict(record).items() if k != "itl"}, "tpot": record.tpot}


def describe_cpu_use(run: dict) -> str | None:
    cpu = run.get("cpu_s") or {}
    parts = [f"{name} {seconds:.1f}" for name, seconds in cpu.items() if seconds is not None]
    if not parts:
        return None
    per_request = ""
    if cpu.get("gateway") is not None and run["completed"]:
        per_request = f" (gateway {1000 * cpu['gateway'] / run['completed']:.1f} ms/request)"
    return f"CPU s: {', '.join(parts)}{per_request} over {run['duration_s']:.1f} s wall"


# ---- replicas and sweeps ---------------------------------------------------------------------
@contextlib.contextmanager
def replica_for(args, variant_args: str):
    """A Target: the running replica at --redis-url, or one spawned on --redis-url if given,
    else on a fresh embedded Valkey; plus, for http runs, --gateway-url or a gateway
    spawned against that Redis."""
    if not args.spawn:
        with gateway_for(args, Target(args.redis_url)) as target:
            yield target
        return
    engine_args = f"{args.engine_args} {variant_args}".strip()
    server = contextlib.nullcontext(args.redis_url) if args.redis_url else embedded_valkey()
    with server as url, spawned_replica(args.model, url, engine_args, args.replica_log) as replica:
        with gateway_for(args, Target(url, replica)) as target:
            yield target


@contextlib.contextmanager
def gateway_for(args, target: Target):
    if "http" not in MODES[args.mode]:
        yield target
    elif args.gateway_url:
        target.gateway_url = args.gateway_url.rstrip("/")
        yield target
    else:
        with spawned_gateway(target.redis_url, args.namespace, args.gateway_log or args.replica_log) as (url, gateway):
            target.gateway_url, target.gateway = url, gateway
            yield target


def run_sweep(args, workloads) -> list[dict]:
    """``workloads(rate_index, content_index)``: the requests of rate ``args.rates[rate_index]``
    (content_index 0: the default prompts; others: same lengths, new tokens)."""
    runs = []
    modes = MODES[args.mode]
    for variant, variant_args in engine_variants(args):
        with replica_for(args, variant_args) as target:
            if args.warmup:
                warm_up(target, workloads, args, variant)
            for rate_index, rate in enumerate(args.rates):
                for round_index in range(args.rounds):
                    for mode in round_order(modes, round_index, args.order):
                        requests = workloads(rate_index, round_index * len(modes) + modes.index(mode))
                        label = (
                            variant
                            + (f" {mode}" if args.mode != "queue" else "")
                            + (f" round {round_index + 1}" if args.rounds > 1 else "")
                        )
                        run = asyncio.run(run_benchmark(target, requests, rate, args, f"{label} rate {rate:g}/s", mode))
                        runs.append({"variant": variant, "mode": mode, "round": round_index + 1, **run})
                        print(describe_run(runs[-1], args), flush=True)
    return runs


def round_order(modes: tuple[str, ...], round_index: int, order: str) -> tuple[str, ...]:
    """alternate: queue, http in every round; abba: reversed in every second round
    (queue, http, http, queue...), so a steady drift of the machine (warming up, the
    host's noise) favours neither."""
    return modes[::-1] if order == "abba" and round_index % 2 else modes


def warm_up(target: Target, workloads, args, variant: str) -> None:
    """``--warmup`` requests of the first rate's shapes, all at once, through each path
    (the replica's first batches of that size, the gateway's first streams); not reported."""
    for mode_index, mode in enumerate(MODES[args.mode]):
        requests = workloads(0, 10_000 + mode_index)[: args.warmup]
        run = asyncio.run(
            run_benchmark(target, requests, math.inf, args, f"{variant} {mode} warm-up", mode, warmup=True)
        )
        if run["failed"]:
            raise RuntimeError(f"{run['failed']} warm-up requests through {mode} failed: {run['errors']}")


def engine_variants(args) -> list[tuple[str, str]]:
    """(label, extra `conveyor serve` flags): one replica per batching policy x prefix-cache
    setting swept; a single ("as configured", "") when nothing is swept."""
    variants = []
    for policy in args.policies or [None]:
        for caching in args.prefix_caching or [None]:
            label = ", ".join(part for part in (policy, caching and f"prefix cache {caching}") if part)
            flags = " ".join(
                flag
                for flag in (
                    policy and f"--batching {policy}",
                    caching and f"--enable-prefix-caching {caching == 'on'}",
                )
                if flag
            )
            variants.append((label or "as configured", flags))
    return variants


def describe_run(run: dict, args) -> str:
    path = "" if args.mode == "queue" else f", {MODE_NAMES[run['mode']]}"
    rounds = f", round {run['round']} of {args.rounds}" if args.rounds > 1 else ""
    lines = [
        f"== {run['variant']}{path}{rounds}, request rate {run['request_rate']:g}/s, "
        f"max concurrency {run['max_concurrency'] or '-'} ==",
        f"completed {run['completed']}, failed {run['failed']}, {run['duration_s']:.1f} s",
        f"request throughput {run['request_throughput']:.2f} req/s, output {run['output_tokens_per_s']:.1f} "
        f"tok/s, total {run['total_tokens_per_s']:.1f} tok/s",
        f"goodput {run['goodput']:.2f} req/s ({describe_slo(args)})",
    ]
    for name in LATENCIES:
        stats = run[name]
        if stats["mean"] is not None:
            lines.append(
                f"  {name:>5} ms: mean {1000 * stats['mean']:8.1f}  median {1000 * stats['p50']:8.1f}  "
                f"p99 {1000 * stats['p99']:8.1f}"
            )
    lines += [f"  error: {error}" for error in run["errors"]]
    cpu = describe_cpu_use(run)
    return "\n".join(lines + ([cpu] if cpu and args.mode != "queue" else []))


def describe_slo(args) -> str:
    slos = [
        f"{name} <= {value} s"
        for name, value in (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot))
        if value is not None
    ]
    return " and ".join(slos) if slos else "no SLO given: every completed request counts"


def sweep_table(runs: list[dict], args) -> str:
    path = args.mode != "queue" or args.rounds > 1
    rows = [
        {
            "variant": r["variant"],
            **({"mode": r["mode"], "round": r["round"]} if path else {}),
            "rate": r["request_rate"],
            "req/s": r["request_throughput"],
            "out tok/s": r["output_tokens_per_s"],
            "goodput": r["goodput"],
            **{f"{name} {stat} ms": _ms(r[name][stat]) for name in ("ttft", "tpot", "e2e") for stat in ("p50", "p99")},
            "failed": r["failed"],
        }
        for r in runs
    ]
    return format_table(rows, list(rows[0]))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# ---- gateway vs queue ------------------------------------------------------------------------
# (row name, run key, statistic or None for a plain figure, higher is better)
COMPARED = [
    ("ttft mean ms", "ttft", "mean", False),
    ("ttft median ms", "ttft", "p50", False),
    ("ttft p99 ms", "ttft", "p99", False),
    ("tpot median ms", "tpot", "p50", False),
    ("itl median ms", "itl", "p50", False),
    ("e2e median ms", "e2e", "p50", False),
    ("e2e p99 ms", "e2e", "p99", False),
    ("output tok/s", "output_tokens_per_s", None, True),
    ("request/s", "request_throughput", None, True),
]
TARGETED = ("ttft mean ms", "ttft median ms", "ttft p99 ms", "output tok/s")


def _figure(run: dict, key: str, stat: str | None) -> float | None:
    return run[key] if stat is None else _ms(run[key][stat])


def compare_modes(runs: list[dict], order: str = "alternate") -> list[dict]:
    """Per engine variant and rate with both modes: each figure per round, the gateway/queue
    ratio of each round's pair, and the gateway's cost in percent (+: worse through the
    gateway: higher latency, lower throughput)."""
    comparisons = []
    for variant in _unique(r["variant"] for r in runs):
        for rate in _unique(r["request_rate"] for r in runs if r["variant"] == variant):
            pairs = _pairs([r for r in runs if r["variant"] == variant and r["request_rate"] == rate])
            if not pairs:
                continue
            figures = {mode: {} for mode in ("queue", "http")}
            ratios, costs = {}, {}
            for name, key, stat, higher_better in COMPARED:
                for index, mode in enumerate(("queue", "http")):
                    figures[mode][name] = [_figure(pair[index], key, stat) for pair in pairs]
                ratio = [
                    None if None in (q, h) or not q else h / q
                    for q, h in zip(figures["queue"][name], figures["http"][name])
                ]
                ratios[name] = ratio
                costs[name] = [None if x is None else 100 * ((1 - x) if higher_better else (x - 1)) for x in ratio]
            cpu = {
                mode: {
                    proc: _mean([pair[index]["cpu_s"].get(proc) for pair in pairs])
                    for proc in ("replica", "gateway", "client")
                }
                for index, mode in enumerate(("queue", "http"))
            }
            worst = max(TARGETED, key=lambda n: _mean(costs[n]) if _mean(costs[n]) is not None else -math.inf)
            comparisons.append(
                {
                    "variant": variant,
                    "request_rate": rate,
                    "rounds": len(pairs),
                    "order": order,
                    "queue": figures["queue"],
                    "http": figures["http"],
                    "ratio": ratios,
                    "cost_percent": costs,
                    "cpu_s": cpu,
                    "failed": sum(r["failed"] for pair in pairs for r in pair),
                    "target_cost_percent": TARGET_COST_PERCENT,
                    "worst": worst,
                    "target_met": all(
                        _mean(costs[n]) is not None and _mean(costs[n]) < TARGET_COST_PERCENT for n in TARGETED
                    ),
                }
            )
    return comparisons


def _pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(queue run, http run) of each round that has both."""
    by_round = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["mode"]] = run
    return [(modes["queue"], modes["http"]) for _, modes in sorted(by_round.items()) if len(modes) == 2]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _spread(values, text) -> str:
    """mean [min, max] over rounds (just the value for one round)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return text(values[0])
    return f"{text(_mean(values))} [{text(min(values))}, {text(max(values))}]"


def comparison_table(comparison: dict) -> str:
    figure, ratio, cost = (lambda v: f"{v:.4g}"), (lambda v: f"{v:.3f}"), (lambda v: f"{v:+.1f}%")
    rows = [
        {
            "": name,
            "queue": _spread(comparison["queue"][name], figure),
            "http (gateway)": _spread(comparison["http"][name], figure),
            "gateway/queue": _spread(comparison["ratio"][name], ratio),
            "gateway cost": _spread(comparison["cost_percent"][name], cost),
        }
        for name, *_ in COMPARED
    ]
    cpu = comparison["cpu_s"]
    for proc in ("replica", "gateway", "client"):
        if cpu["queue"][proc] is not None or cpu["http"][proc] is not None:
            rows.append(
                {
                    "": f"{proc} CPU s/run",
                    "queue": _spread([cpu["queue"][proc]], figure),
                    "http (gateway)": _spread([cpu["http"][proc]], figure),
                }
            )
    spread = "mean [min, max] over rounds" if comparison["rounds"] > 1 else "one round"
    header = (
        f"== gateway vs queue: {comparison['variant']}, request rate {comparison['request_rate']:g}/s, "
        f"{comparison['rounds']} round{'s' * (comparison['rounds'] > 1)} ({comparison['order']}), {spread} =="
    )
    worst = comparison["worst"]
    verdict = (
        f"target: the gateway costs < {TARGET_COST_PERCENT:g}% on TTFT mean/median/p99 and output tok/s: "
        f"{'MET' if comparison['target_met'] else 'NOT MET'} (largest: {worst} "
        f"{_spread(comparison['cost_percent'][worst], cost)})"
    )
    failed = [f"failed requests: {comparison['failed']}"] if comparison["failed"] else []
    return "\n".join([header, format_table(rows, list(rows[0])), verdict, *failed])


def plot_sweep(runs: list[dict], path: str) -> None:
    """TTFT and e2e (median solid, P99 dashed) and output tokens/s vs request rate, a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    finite = [r for r in runs if math.isfinite(r["request_rate"])]
    both = len(_unique(r.get("mode", "queue") for r in runs)) > 1
    series = lambda r: f"{r['variant']} {r['mode']}" if both else r["variant"]  # noqa: E731
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for color, variant in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], _unique(map(series, finite))):
        mine = [r for r in finite if series(r) == variant]
        rates = _unique(r["request_rate"] for r in mine)  # rounds of a rate: their mean
        at = lambda rate, get: _mean([get(r) for r in mine if r["request_rate"] == rate])  # noqa: E731
        for axis, metric in zip(axes, ("ttft", "e2e")):
            axis.plot(
                rates,
                [at(x, lambda r: _ms(r[metric]["p50"])) for x in rates],
                "o-",
                color=color,
                label=f"{variant} median",
            )
            axis.plot(
                rates,
                [at(x, lambda r: _ms(r[metric]["p99"])) for x in rates],
                "s--",
                color=color,
                label=f"{variant} P99",
            )
        axes[2].plot(
            rates, [at(x, lambda r: r["output_tokens_per_s"]) for x in rates], "o-", color=color, label=variant
        )
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
    target.add_argument(
        "--spawn",
        action="store_true",
        help="start a replica per swept variant, on an embedded Valkey unless --redis-url "
        "(the default when no --redis-url is given)",
    )
    target.add_argument("--model", default="smollm2")
    target.add_argument(
        "--engine-args", default="", help='flags for the spawned conveyor serve, e.g. --engine-args="--max-num-seqs 32"'
    )
    target.add_argument("--replica-log", help="append the spawned replica's output here (default: this terminal)")
    target.add_argument(
        "--mode",
        default="queue",
        choices=list(MODES),
        help="queue: clients.AsyncClient on Redis (default); http: streaming /v1/completions "
        "through the gateway; both: alternating on the same replica, with ratios",
    )
    target.add_argument(
        "--gateway-url",
        help="a running gateway on the replica's Redis (http/both); default: "
        "spawn `conveyor gateway` on a free loopback port",
    )
    target.add_argument("--gateway-log", help="append the spawned gateway's output here (default: --replica-log)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    load.add_argument("--rates", type=float, nargs="+", help="sweep these request rates")
    load.add_argument("--policies", nargs="+", choices=["continuous", "dynamic"], help="sweep these (implies --spawn)")
    load.add_argument(
        "--prefix-caching", nargs="+", choices=["on", "off"], help="sweep prefix caching on/off (implies --spawn)"
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--priority-class", default="interactive", choices=["interactive", "batch"])
    load.add_argument("--request-timeout", type=float, default=600.0, help="longest wait for a request's next event")
    load.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs of each rate per mode, alternating modes (default: 2 with --mode both, else 1)",
    )
    load.add_argument(
        "--order",
        default="abba",
        choices=["alternate", "abba"],
        help="--mode both: queue then http every round (alternate), or reversed every "
        "second round (abba, default: cancels a steady drift, measured here)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests sent through each path before measuring (default: 4 in http/both, 0 in queue)",
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", default="random", choices=["random", "mixed", "summarization"])
    workload.add_argument("--num-prompts", type=int, default=30)
    workload.add_argument("--input-len", type=int, help="random: 128, summarization: 1024 (mixed: fixed ranges)")
    workload.add_argument("--output-len", type=int, help="random: 32, summarization: 32")
    workload.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len x [1-r, 1+r]")
    workload.add_argument("--shared-prefix-tokens", type=int, default=0, help="same leading tokens in every prompt")
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument(
        "--prompt-format",
        default="ids",
        choices=["ids", "text"],
        help="send prompts as token ids (default) or as their decoded text (both modes)",
    )
    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    report.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    report.add_argument("--json", metavar="PATH")
    report.add_argument("--plot", metavar="PATH", help="PNG of latency and throughput vs rate (sweeps)")
    args = parser.parse_args(argv)
    needs_queue = args.mode != "http" or not args.gateway_url
    args.spawn = args.spawn or bool(args.policies) or bool(args.prefix_caching) or (not args.redis_url and needs_queue)
    if args.spawn and args.gateway_url and not args.redis_url:
        parser.error("--gateway-url reads its own Redis: give it as --redis-url for the spawned replica")
    if args.gateway_url and args.mode == "queue":
        parser.error("--gateway-url needs --mode http or both")
    args.rates = args.rates or [args.request_rate]
    args.rounds = args.rounds or (2 if args.mode == "both" else 1)
    args.warmup = (0 if args.mode == "queue" else 4) if args.warmup is None else args.warmup
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    cpu = cpu_info()
    print(describe_cpu(cpu), flush=True)
    vocab, tokenizer = vocab_size(args.model), load_tokenizer(args.model) if args.prompt_format == "text" else None
    cache = {}

    def workloads(rate_index: int, content_index: int) -> list[Request]:
        key = (rate_index, content_index)
        if key not in cache:
            cache[key] = build_workload(args, vocab, rate_index, content_index, tokenizer)
        return cache[key]

    runs = run_sweep(args, workloads)
    if len(runs) > 1:
        print("\n" + sweep_table(runs, args))
    comparisons = compare_modes(runs, args.order) if args.mode == "both" else []
    for comparison in comparisons:
        print("\n" + comparison_table(comparison))
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    write_json(
        args.json,
        {
            "settings": settings,
            "cpu": cpu,
            "workload": describe_workload(workloads(0, 0)),
            "runs": runs,
            "comparisons": comparisons,
        },
    )
    if args.plot:
        plot_sweep(runs, args.plot)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from conveyor.engine.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def describe_workload(requests: list[Request]) -> dict:
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
    }


if __name__ == "__main__":
    main()
