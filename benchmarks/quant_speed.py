"""GGUF-native weights vs the same weights dequantized to float32, alternating in one run.

    python benchmarks/quant_speed.py [--model smollm2] [--rounds 5] [--json quant_speed.json]

Loads the model once per mode in this process (``--modes``, default all four):
``quantization="auto"`` (the GGUF blocks on float32 activations for steps of few rows plus a
float32 oneDNN copy for many), ``"gguf_int8"`` (the blocks alone, integer dots on int8
activations for steps of few rows, kernels/csrc/int8_dot_cpu.cpp), ``"gguf"`` (the blocks
alone on float32 activations, kernels/csrc/quant_linear_cpu.cpp) and
``"none"`` (float32), and alternates rounds A B C D A B C D ... of:

- single-stream decode: a 16-token prompt, 128 output tokens, ignore_eos; tokens/s from
  the first token to the last;
- batched: ``--batch`` requests at once (32-token prompts, ``--batch-output`` tokens each);
  output tokens/s over the whole call, prefill included.

Prints the CPU and the ISA the kernels were compiled for, the median and the range (min-max)
of each, the ratio of the medians, the load time and the RSS after each load. The machine
is shared: read the spread before the median.
"""

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_json_option, describe_cpu, format_table, random_prompt, vocab_size, write_json  # noqa: E402

MODES = ("auto", "gguf_int8", "gguf", "none")


def rss_mib() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM", "RssAnon")}


def greedy(max_tokens: int):
    from conveyor.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def single(llm, prompt, tokens: int) -> float:
    output = llm.generate([prompt], greedy(tokens), use_tqdm=False)[0]
    return (len(output.token_ids) - 1) / (output.metrics.e2e - output.metrics.ttft)


def batched(llm, prompts, tokens: int) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(tokens), use_tqdm=False)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-output", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); on a shared, oversubscribed box 1 avoids OpenMP spinning",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated quantization modes (none is always run)"
    )
    add_json_option(parser)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m != "none"] + ["none"]
    import torch

    from conveyor.engine import LLM
    from conveyor.kernels.cpu import extension

    kernels = extension.load()
    if args.threads:
        torch.set_num_threads(args.threads)
    from conveyor.kernels.cpu.dispatch import cpu_flags, int8_dot_isa

    print(
        describe_cpu(),
        f"| quantized kernel: {kernels.quant_isa() if kernels else 'torch reference'}",
        f"| int8 dot: {int8_dot_isa(cpu_flags())}",
        f"| torch threads: {torch.get_num_threads()}",
    )
    vocab = vocab_size(args.model)
    rng = random.Random(1)
    prompt = random_prompt(rng, 16, vocab)
    prompts = [random_prompt(rng, 32, vocab) for _ in range(args.batch)]
    engines, loads = {}, {}
    for mode in modes:
        gc.collect()
        start = time.perf_counter()
        engines[mode] = LLM(
            args.model,
            dtype="float32",
            device="cpu",
            quantization=mode,
            kv_cache_memory="256MiB",
            max_num_seqs=max(args.batch, 1),
        )
        loads[mode] = {"load_s": time.perf_counter() - start, **rss_mib()}
        engines[mode].generate([prompt[:8]], greedy(4), use_tqdm=False)  # warm-up
    results = {mode: {"single": [], "batched": []} for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode]["single"].append(single(engines[mode], prompt, args.single_tokens))
        for mode in modes:
            results[mode]["batched"].append(batched(engines[mode], prompts, args.batch_output))
    rows = []
    for workload in ("single", "batched"):
        medians = {mode: statistics.median(results[mode][workload]) for mode in modes}
        for mode in modes:
            values = results[mode][workload]
            rows.append(
                {
                    "workload": workload,
                    "weights": mode,
                    "median tok/s": medians[mode],
                    "min": min(values),
                    "max": max(values),
                    "vs none": medians[mode] / medians["none"],
                }
            )
    print(
        f"\n{args.rounds} alternating rounds; single: 16 in, {args.single_tokens} out; batched: {args.batch}"
        f" x (32 in, {args.batch_output} out), output tok/s"
    )
    print(format_table(rows, list(rows[0])))
    print("\nafter each load (MiB; the second load's VmHWM includes the first engine):")
    print(format_table([{"weights": m, **loads[m]} for m in modes], ["weights", "load_s", "VmRSS", "VmHWM", "RssAnon"]))
    write_json(args.json, {"settings": vars(args), "cpu": describe_cpu(), "loads": loads, "results": results})


if __name__ == "__main__":
    main()
