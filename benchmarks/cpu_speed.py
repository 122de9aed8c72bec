"""How close our engine gets to this CPU's limits, and to transformers, in one run.

    python benchmarks/cpu_speed.py [--model smollm2] [--quick] [--json cpu_speed.json]

SmolLM2-135M float32 activations through ``engine.LLM`` (weights: the GGUF blocks by
default, ``--quantization none`` for float32; benchmarks/quant_speed.py alternates both);
the limits come from benchmarks/limits.py.

(a) single-stream decode tokens/s (one request, 16-token prompt, 128 tokens, ignore_eos;
    first token to last only) as a fraction of the bandwidth bound, in 5 rounds each
    against the read bandwidth measured just before it (it swings on this machine);
(b) saturated throughput: 64 concurrent decode-heavy requests (32-token prompts, 128
    tokens each); processed (prompt + output) tokens/s as a fraction of the matmul bound;
(c) engine overhead with 64 running sequences: per decode step, the time in
    ``engine.schedule()``, the runner's ``_prepare``, model forward + sampling and
    ``engine.postprocess``; overhead = (schedule + prepare + postprocess) / step. A
    cProfile and a torch profiler summary of a few more steps back the number;
(d) the mixed workload of benchmarks/offline.py: ours vs transformers ``generate`` in
    static batches and vs transformers' own continuous batching (the manager behind
    ``generate_batch``), same prompts, same output lengths, only requested tokens count.
"""

import argparse
import cProfile
import gc
import io
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_json_option, format_table, random_prompt, vocab_size, write_json  # noqa: E402
from limits import bounds_for, describe, matmul_gflops, memory_read_gbps  # noqa: E402
from offline import make_workload, run_ours, run_transformers  # noqa: E402

SECTIONS = ("single", "saturated", "overhead", "mixed")
SINGLE_PROMPT_TOKENS, BATCH_PROMPT_TOKENS = 16, 32
FULL = dict(
    single_tokens=128,
    single_rounds=5,
    saturated_seqs=64,
    saturated_output=128,
    overhead_seqs=64,
    overhead_steps=32,
    profile_steps=8,
    num_requests=32,
    hf_batch_sizes=[8, 32],
)
QUICK = dict(
    single_tokens=32,
    single_rounds=2,
    saturated_seqs=32,
    saturated_output=8,
    overhead_seqs=32,
    overhead_steps=6,
    profile_steps=2,
    num_requests=4,
    hf_batch_sizes=[4],
)


def greedy(max_tokens: int):
    from conveyor.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- (a) single stream -----------------------------------------------------------------------
def single_stream_decode(llm, vocab: int, output_tokens: int, rounds: int, bounds: dict) -> dict:
    """``rounds`` x (measure read GB/s, decode ``output_tokens``): this machine's read bandwidth
    swings between about 30 and 48 GB/s from one minute to the next (where the host places
    the two vCPUs), so each decode is compared with a bandwidth measured just before it and
    the median fraction is reported."""
    prompt = random_prompt(random.Random(1), SINGLE_PROMPT_TOKENS, vocab)
    runs = [_single_round(llm, prompt, output_tokens, bounds["weight_bytes_per_step"]) for _ in range(rounds)]
    median = sorted(runs, key=lambda r: r["fraction_of_bound"])[len(runs) // 2]
    return {"prompt_tokens": len(prompt), "output_tokens": output_tokens, "rounds": runs, **median}


def _single_round(llm, prompt: list[int], output_tokens: int, weight_bytes: int) -> dict:
    read_gbps = memory_read_gbps(repeats=3)
    output = llm.generate([prompt], greedy(output_tokens), use_tqdm=False)[0]
    decode_s = output.metrics.e2e - output.metrics.ttft  # first token -> last token
    tokens_per_s = (len(output.token_ids) - 1) / decode_s
    bound = read_gbps * 1e9 / weight_bytes
    return {
        "read_gbps": read_gbps,
        "tokens_per_s": tokens_per_s,
        "ms_per_token": 1000 / tokens_per_s,
        "bound_tokens_per_s": bound,
        "fraction_of_bound": tokens_per_s / bound,
    }


# ---- (b) saturated throughput ----------------------------------------------------------------
def saturated_throughput(llm, vocab: int, num_seqs: int, output_tokens: int, bounds: dict) -> dict:
    rng = random.Random(2)
    prompts = [random_prompt(rng, BATCH_PROMPT_TOKENS, vocab) for _ in range(num_seqs)]
    preempted_before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(output_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    output_count = sum(len(o.token_ids) for o in outputs)
    processed = output_count + sum(len(p) for p in prompts)
    tokens_per_s = processed / seconds
    return {
        "num_seqs": num_seqs,
        "prompt_tokens_each": BATCH_PROMPT_TOKENS,
        "output_tokens_each": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_count / seconds,
        "processed_tokens_per_s": tokens_per_s,
        "bound_tokens_per_s": bounds["throughput_tokens_per_s_bound"],
        "fraction_of_bound": tokens_per_s / bounds["throughput_tokens_per_s_bound"],
        "achieved_gflops": tokens_per_s * 2 * bounds["matmul_params"] / 1e9,
        "preemptions": llm.engine.scheduler.num_preemptions - preempted_before,
    }


# ---- (c) engine overhead per decode step -----------------------------------------------------
class PrepareClock:
    """Wraps ``runner._prepare`` (called inside ``runner.execute``) to time it; ``take()``
    returns the seconds since the last take."""

    def __init__(self, runner):
        self.runner, self.original, self.seconds = runner, runner._prepare, 0.0
        runner._prepare = self._timed

    def _timed(self, *args):
        start = time.perf_counter()
        try:
            return self.original(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def restore(self) -> None:
        del self.runner._prepare  # the instance attribute; the class method shows again


def run_step(engine) -> tuple[object, dict]:
    """One engine step driven by hand, each phase timed."""
    t0 = time.perf_counter()
    plan = engine.schedule()
    t1 = time.perf_counter()
    result = engine.runner.execute(plan)
    t2 = time.perf_counter()
    engine.postprocess(plan, result)
    t3 = time.perf_counter()
    return plan, {"schedule": t1 - t0, "execute": t2 - t1, "postprocess": t3 - t2, "step": t3 - t0}


def fill_with_decoders(engine, vocab: int, num_seqs: int, max_tokens: int) -> list[str]:
    """Add ``num_seqs`` requests and step until one step decodes all of them."""
    rng = random.Random(3)
    ids = [f"overhead-{i}" for i in range(num_seqs)]
    for request_id in ids:
        engine.add_request(request_id, random_prompt(rng, BATCH_PROMPT_TOKENS, vocab), greedy(max_tokens))
    while True:
        plan, _ = run_step(engine)
        if len(plan.scheduled) == num_seqs and all(s.num_new == 1 for s in plan.scheduled):
            return ids


def step_overhead(llm, vocab: int, num_seqs: int, steps: int, profile_steps: int) -> dict:
    engine = llm.engine
    ids = fill_with_decoders(engine, vocab, num_seqs, max_tokens=steps + 2 * profile_steps + 8)
    clock = PrepareClock(engine.runner)
    try:
        phases = [_decode_phases(engine, clock, num_seqs) for _ in range(steps)]
    finally:
        clock.restore()
    profiles = {"cprofile": cprofile_steps(engine, profile_steps), "torch": torch_profile_steps(engine, profile_steps)}
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"num_seqs": num_seqs, "steps": steps, **summarize_phases(phases), "profiles": profiles}


def _decode_phases(engine, clock: PrepareClock, num_seqs: int) -> dict:
    plan, timing = run_step(engine)
    assert len(plan.scheduled) == num_seqs and all(s.num_new == 1 for s in plan.scheduled), "not a pure decode step"
    prepare = clock.take()
    assert prepare > 0, "runner.execute no longer calls runner._prepare: update PrepareClock"
    return {
        "schedule": timing["schedule"],
        "prepare": prepare,
        "forward_sample": timing["execute"] - prepare,
        "postprocess": timing["postprocess"],
        "step": timing["step"],
    }


def summarize_phases(phases: list[dict]) -> dict:
    mean_ms = {name: 1000 * sum(p[name] for p in phases) / len(phases) for name in phases[0]}
    overhead_ms = mean_ms["schedule"] + mean_ms["prepare"] + mean_ms["postprocess"]
    return {"mean_ms": mean_ms, "overhead_ms": overhead_ms, "overhead_fraction": overhead_ms / mean_ms["step"]}


def cprofile_steps(engine, steps: int, top: int = 15) -> dict:
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [run_step(engine) for _ in range(steps)])
    by_self, by_cumulative = io.StringIO(), io.StringIO()
    pstats.Stats(profiler, stream=by_self).sort_stats("tottime").print_stats(top)
    pstats.Stats(profiler, stream=by_cumulative).sort_stats("cumulative").print_stats(r"engine|kernels", top)
    return {
        "steps": steps,
        "by_self_time": _pstats_body(by_self.getvalue()),
        "engine_by_cumulative_time": _pstats_body(by_cumulative.getvalue()),
    }


def _pstats_body(text: str) -> str:
    """Drop pstats' preamble (file names, totals) up to the column header."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(line for line in lines[start:] if line.strip())


def torch_profile_steps(engine, steps: int, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            run_step(engine)
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return {"steps": steps, "by_self_cpu_time": table}


# ---- (d) mixed workload vs transformers ------------------------------------------------------
def run_transformers_continuous(
    model_dir, prompts, output_lens, max_num_seqs: int, max_num_batched_tokens: int
) -> dict:
    """transformers' continuous batching (the manager ``generate_batch`` wraps) with the
    same limits as ours: paged KV cache of the same size and block size, the same token
    budget and number of running sequences. ``generate_batch`` itself takes one
    ``max_new_tokens`` for all prompts, so requests go to its manager one by one."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from conveyor.engine import EngineConfig
    from conveyor.engine.model_runner import CPU_KV_CACHE_BYTES

    block_size = EngineConfig.block_size
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generation = GenerationConfig(
        do_sample=False,
        eos_token_id=-1,
        max_new_tokens=max(output_lens),  # -1: ignore EOS
        pad_token_id=hf.generation_config.pad_token_id or 0,
    )
    config = ContinuousBatchingConfig(
        page_size=block_size,
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        num_blocks=CPU_KV_CACHE_BYTES // (block_size * _kv_bytes_per_token(hf.config)),
    )
    with (
        torch.inference_mode(),
        hf.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=config
        ) as manager,
    ):
        _collect(manager, [manager.add_request(prompts[0][:8], max_new_tokens=4)])  # warm-up
        start = time.perf_counter()
        request_ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, output_lens)]
        results = _collect(manager, request_ids, progress="transformers continuous")
        elapsed = time.perf_counter() - start
    tokens = sum(min(len(r.generated_tokens), n) for r, n in zip(results, output_lens))
    assert tokens == sum(output_lens), f"transformers CB produced {tokens} of {sum(output_lens)} requested tokens"
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def _kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32 K and V


def _collect(manager, request_ids: list[str], progress: str | None = None) -> list:
    """Finished results of ``request_ids``, in that order; ``progress``: a bar's title."""
    from tqdm import tqdm

    finished = {}
    with tqdm(total=len(request_ids), desc=progress, disable=progress is None) as bar:
        while len(finished) < len(request_ids):
            _collect_one(manager, finished, bar)
    return [finished[request_id] for request_id in request_ids]


def _collect_one(manager, finished: dict, bar) -> None:
    result = manager.get_result(timeout=1)
    if result is None:
        if not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread died (see its log above)")
    elif result.is_finished():
        if result.error:
            raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
        finished[result.request_id] = result
        bar.update(1)


def mixed_workload(
    model: str, num_requests: int, hf_batch_sizes: list[int], max_num_seqs: int, max_num_batched_tokens: int
) -> dict:
    from conveyor.engine.models.loader import load_spec

    spec = load_spec(model)
    prompts, output_lens = make_workload(num_requests, spec.hf_config.vocab_size)
    results = {
        "ours": run_ours(
            model, prompts, output_lens, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
    }
    gc.collect()
    for batch_size in hf_batch_sizes:
        results[f"transformers_static_bs{batch_size}"] = run_transformers(
            spec.model_dir, prompts, output_lens, batch_size
        )
    results["transformers_continuous"] = run_transformers_continuous(
        spec.model_dir, prompts, output_lens, max_num_seqs, max_num_batched_tokens
    )
    ours = results["ours"]["tokens_per_s"]
    for result in results.values():
        result["ours_over_this"] = ours / result["tokens_per_s"]
    return {
        "num_requests": num_requests,
        "output_tokens": sum(output_lens),
        "prompt_tokens": sum(len(p) for p in prompts),
        "runs": results,
    }


# ---- report ----------------------------------------------------------------------------------
def report(results: dict) -> str:
    parts = [describe(results["limits"])]
    if "single" in results:
        s = results["single"]
        rows = [
            {
                "round": i + 1,
                "read GB/s": r["read_gbps"],
                "bound tok/s": r["bound_tokens_per_s"],
                "tok/s": r["tokens_per_s"],
                "ms/token": r["ms_per_token"],
                "of bound": r["fraction_of_bound"],
            }
            for i, r in enumerate(s["rounds"])
        ]
        parts.append(
            f"\n(a) single-stream decode, {s['output_tokens']} tokens per round, each against the"
            f" bandwidth measured just before it:\n"
            + format_table(rows, list(rows[0]))
            + f"\nmedian: {s['tokens_per_s']:.1f} tokens/s = {s['fraction_of_bound']:.0%} of the bandwidth"
            f" bound {s['bound_tokens_per_s']:.1f} ({s['read_gbps']:.1f} GB/s)"
        )
    if "saturated" in results:
        s = results["saturated"]
        parts.append(
            f"\n(b) saturated, {s['num_seqs']} sequences: {s['processed_tokens_per_s']:.1f} processed tokens/s"
            f" ({s['output_tokens_per_s']:.1f} output), {s['achieved_gflops']:.1f} GFLOP/s"
            f" = {s['fraction_of_bound']:.0%} of the matmul bound {s['bound_tokens_per_s']:.1f};"
            f" {s['preemptions']} preemptions"
        )
    if "overhead" in results:
        parts.append(_overhead_report(results["overhead"]))
    if "mixed" in results:
        parts.append(_mixed_report(results["mixed"]))
    return "\n".join(parts)


def _overhead_report(overhead: dict) -> str:
    profiles = overhead["profiles"]
    ms = overhead["mean_ms"]
    rows = [{"phase": name, "ms/step": ms[name], "share": ms[name] / ms["step"]} for name in ms]
    return "\n".join(
        [
            f"\n(c) one decode step with {overhead['num_seqs']} running sequences (mean of {overhead['steps']} steps):",
            format_table(rows, ["phase", "ms/step", "share"]),
            f"overhead (schedule + prepare + postprocess) = {overhead['overhead_ms']:.2f} ms"
            f" = {overhead['overhead_fraction']:.1%} of a step",
            f"\ncProfile of {profiles['cprofile']['steps']} steps, by self time:",
            profiles["cprofile"]["by_self_time"],
            "\nengine/kernels functions by cumulative time:",
            profiles["cprofile"]["engine_by_cumulative_time"],
            f"\ntorch profiler of {profiles['torch']['steps']} steps, by self CPU time:",
            profiles["torch"]["by_self_cpu_time"],
        ]
    )


def _mixed_report(mixed: dict) -> str:
    rows = [
        {
            "run": name,
            "output tok/s": run["tokens_per_s"],
            "seconds": run["seconds"],
            "ours / this": run["ours_over_this"],
        }
        for name, run in mixed["runs"].items()
    ]
    return "\n".join(
        [
            f"\n(d) mixed workload: {mixed['num_requests']} requests, prompts 32-256, outputs 16-128 "
            f"({mixed['output_tokens']} output tokens)",
            format_table(rows, ["run", "output tok/s", "seconds", "ours / this"]),
        ]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="short runs: noisy figures, for checking the script")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "gguf", "none"],
        help="GGUF blocks (auto/gguf) or float32 weights (none)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "auto"],
        help="float32 activations on the blocks, or the default path (auto: int8 GEMMs where the CPU has them)",
    )
    add_json_option(parser)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    results = {"settings": {**sizes, "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads()}}
    results.update(measure(args, sizes))
    print("\n" + report(results))
    write_json(args.json, results)


def measure(args, sizes: dict) -> dict:
    from conveyor.engine import LLM

    gflops, read_gbps = matmul_gflops(), memory_read_gbps()  # before the model takes memory
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=max(sizes["saturated_seqs"], sizes["overhead_seqs"]),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    bounds = bounds_for(args.model, llm.engine.runner.model, gflops=gflops, read_gbps=read_gbps)
    vocab = vocab_size(args.model)
    llm.generate([random_prompt(random.Random(0), 8, vocab)], greedy(4), use_tqdm=False)  # warm-up
    results = {"limits": bounds}
    if "single" in args.only:
        results["single"] = single_stream_decode(llm, vocab, sizes["single_tokens"], sizes["single_rounds"], bounds)
    if "saturated" in args.only:
        results["saturated"] = saturated_throughput(
            llm, vocab, sizes["saturated_seqs"], sizes["saturated_output"], bounds
        )
    if "overhead" in args.only:
        results["overhead"] = step_overhead(
            llm, vocab, sizes["overhead_seqs"], sizes["overhead_steps"], sizes["profile_steps"]
        )
    del llm
    gc.collect()
    if "mixed" in args.only:
        results["mixed"] = mixed_workload(
            args.model,
            sizes["num_requests"],
            sizes["hf_batch_sizes"],
            max_num_seqs=64,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    return results


if __name__ == "__main__":
    main()
