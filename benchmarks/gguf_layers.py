"""One GGUF linear layer several ways, alternating in one run: integer dots (int8 activations,
kernels/csrc/int8_dot_cpu.cpp, and the repacked GEMM, int8_gemm_cpu.cpp: every ISA variant this
CPU runs of both), float32 activations on the
blocks (quant_linear_cpu.cpp), oneDNN on a prepacked float32 copy (the batch copy of
quantization="auto" in float32) and on a prepacked bfloat16 copy (its batch copy where the CPU
has AVX512-BF16 or AMX; emulated and slow elsewhere, so only run there unless --bf16), and
oneDNN's int8 matmul (``torch.ops.onednn.qlinear_pointwise``, vLLM's W8A8 path: weights int8
per output row from the dequantized blocks, x quantized per token, its cost included), which
the engine does not take: per-token int8 activations cost SmolLM2 ~3% perplexity
(benchmarks/int8_agreement.py, docs/performance.md).

    python benchmarks/gguf_layers.py [--rows 1,4,16,32,64,128] [--rounds 7] [--threads N] [--copies 30]

SmolLM2-135M's projection shapes (qkv 960x576, gate_up 3072x576, down 576x1536) in Q4_1 and
Q8_0 (gguf-py quantizes random weights). Each round times every path on the same input once
(best of a few calls); prints the CPU, the int8 variant run, medians with the spread
(min-max over rounds) and each path's ratio to the float32 copy per round (median, min-max).
The machine may be shared: the ratios within a round are what to read.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, format_table  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def packed_weight(type_name: str, n: int, k: int):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from conveyor.kernels.quant import pack_gguf_blocks

    qtype = GGMLQuantizationType[type_name]
    weight = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    return pack_gguf_blocks(quantize(weight, qtype), int(qtype))


def onednn_int8_packed(dense: torch.Tensor, batch_hint: int):
    """(packed int8 weight, per-row scales, zero points) for oneDNN's int8 matmul, or None."""
    if not hasattr(torch.ops, "onednn") or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None
    scales = dense.abs().amax(1).clamp_min(1e-10) / 127
    qweight = torch.round(dense / scales[:, None]).clamp(-127, 127).to(torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(qweight, [batch_hint, dense.shape[1]])
    return packed, scales, torch.zeros(dense.shape[0], dtype=torch.int64)


def onednn_int8_linear(x: torch.Tensor, packed, scales, zero_points) -> torch.Tensor:
    """x quantized per token (uint8, zero point 128), the int8 matmul into float32 with the
    weight's row scales, then each row times its own scale."""
    x_scales = x.abs().amax(1, keepdim=True).clamp_min_(1e-10).div_(127)
    qx = torch.round(x / x_scales).add_(128).to(torch.uint8)
    y = torch.ops.onednn.qlinear_pointwise(
        qx, 1.0, 128, packed, scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return y.mul_(x_scales)


class Layer:
    """One weight and its copies for each path (``--copies`` of them rotate: weights read cold)."""

    def __init__(self, weight: torch.Tensor, with_bf16: bool, gemm: bool):
        from conveyor.kernels.cpu.linear import onednn_packed
        from conveyor.kernels.quant import dequantize, repack_for_int8_gemm

        dense = dequantize(weight)
        self.weight, self.copy = weight, onednn_packed(dense, 64)
        self.bf16 = onednn_packed(dense.bfloat16(), 64) if with_bf16 else None
        self.repacked = repack_for_int8_gemm(weight) if gemm else None
        self.int8 = onednn_int8_packed(dense, 64)


def rotating(fns: list):
    """A call that runs the next of ``fns`` each time."""
    calls = iter(range(1 << 62))
    return lambda: fns[next(calls) % len(fns)]()


def best_of(fn, calls: int, clock) -> float:
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--types", default="Q4_1,Q8_0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="time the bf16 copy without bf16 hardware too")
    parser.add_argument(
        "--copies",
        type=int,
        default=1,
        help="copies of each weight, called in turn (30: beyond the caches, as a model's layers are read)",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (with --threads 1, the time descheduled on a shared box is left out)",
    )
    args = parser.parse_args()
    from conveyor.kernels.cpu import extension
    from conveyor.kernels.cpu.dispatch import cpu_flags, has_bf16_hardware, int8_dot_isa
    from conveyor.kernels.cpu.linear import onednn_linear

    kernels = extension.load()
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = int8_dot_isa(cpu_flags())
    print(
        describe_cpu(),
        f"| int8 dot: {isa} (runnable: {', '.join(kernels.int8_dot_isas())})",
        f"| torch threads: {torch.get_num_threads()}",
    )
    with_bf16 = args.bf16 or has_bf16_hardware(cpu_flags())
    gemm_isas = kernels.int8_gemm_isas()
    gemm = bool(gemm_isas)
    print(f"int8 GEMM (repacked): {', '.join(gemm_isas) if gemm else 'skipped (no AVX2)'}")
    print(f"bf16 copy: {'timed' if with_bf16 else 'skipped (no AVX512-BF16/AMX; --bf16 times it emulated)'}")
    rows_list = [int(r) for r in args.rows.split(",")]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"clock: {args.clock}")
    table = []
    for type_name in args.types.split(","):
        for shape_name, (n, k) in SHAPES.items():
            layers = [Layer(packed_weight(type_name, n, k), with_bf16, gemm) for _ in range(args.copies)]
            for rows in rows_list:
                x = torch.randn(rows, k)
                paths = {
                    f"int8 dot {variant}": rotating(
                        [lambda w=layer.weight, v=variant: kernels.int8_dot_linear(x, w, None, v) for layer in layers]
                    )
                    for variant in kernels.int8_dot_isas()
                }
                paths["f32 blocks"] = rotating(
                    [lambda w=lay.weight: kernels.quantized_linear(x, w, None) for lay in layers]
                )
                paths["f32 copy"] = rotating([lambda c=lay.copy: onednn_linear(x, c, None) for lay in layers])
                if with_bf16:
                    paths["bf16 copy"] = rotating([lambda c=lay.bf16: onednn_linear(x, c, None) for lay in layers])
                for variant in gemm_isas:
                    paths[f"int8 GEMM {variant}"] = rotating(
                        [lambda r=lay.repacked, v=variant: kernels.int8_gemm_linear(x, *r, None, v) for lay in layers]
                    )
                if layers[0].int8 is not None:
                    paths["int8 oneDNN per token"] = rotating(
                        [lambda c=lay.int8: onednn_int8_linear(x, *c) for lay in layers]
                    )
                times = {name: [] for name in paths}
                for _ in range(args.rounds):
                    for name, fn in paths.items():
                        times[name].append(best_of(fn, args.calls, clock))
                for name in paths:
                    ratios = [c / t for c, t in zip(times["f32 copy"], times[name])]
                    us = [t * 1e6 for t in times[name]]
                    table.append(
                        {
                            "type": type_name,
                            "layer": f"{shape_name} {n}x{k}",
                            "rows": rows,
                            "path": name,
                            "median us": statistics.median(us),
                            "min": min(us),
                            "max": max(us),
                            "speed vs f32 copy": statistics.median(ratios),
                            "ratio min": min(ratios),
                            "ratio max": max(ratios),
                        }
                    )
                print(format_table(table[-len(paths) :], list(table[0])), flush=True)
    print(f"\n{args.rounds} alternating rounds, best of {args.calls} calls each")
    print(format_table(table, list(table[0])))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
