"""What this machine can do at best, and what that bounds a model to.

    python benchmarks/limits.py [--model smollm2] [--json limits.json]

Measures float32 matmul GFLOP/s (torch.mm of 2048x2048 matrices, torch's default
threads, best of a few) and memory read GB/s (sum over a 512 MiB float32 tensor, best of a
few). For a model then prints two ceilings:

- bandwidth-bound single-stream decode: every step reads every weight once, so
  tokens/s <= read GB/s / weight bytes;
- matmul-bound throughput: each processed token (prompt or output) costs about
  2 x params FLOPs (attention scores and softmax not counted), so
  tokens/s <= GFLOP/s / (2 x params).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_json_option, write_json  # noqa: E402

MATMUL_SIZE = 2048
READ_MIB = 512
REPEATS = 10


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(size: int = MATMUL_SIZE, repeats: int = REPEATS) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * size**3 / seconds / 1e9


def memory_read_gbps(mebibytes: int = READ_MIB, repeats: int = REPEATS) -> float:
    data = torch.ones(mebibytes * 2**20 // 4)
    seconds = _best_seconds(data.sum, repeats)
    return data.numel() * data.element_size() / seconds / 1e9


def weight_counts(model: torch.nn.Module) -> dict:
    """Parameters each token runs through a matmul, and the bytes one decode step reads.

    Input embedding tables are lookups (one row per token), except a table tied to the LM
    head, which every step reads in full."""
    params = list(model.parameters())  # tied weights come once
    lookup_only = {id(m.weight) for m in _untied_embeddings(model)}
    matmul = [p for p in params if id(p) not in lookup_only]
    return {
        "params": sum(_weights(p) for p in params),
        "matmul_params": sum(_weights(p) for p in matmul),
        "weight_bytes_per_step": sum(p.numel() * p.element_size() for p in matmul),
    }


def _weights(param: torch.Tensor) -> int:
    """Weights a parameter holds: GGUF blocks (kernels/quant.py) pack several per byte."""
    from conveyor.kernels.quant import in_features_of, is_packed

    return param.shape[0] * in_features_of(param) if is_packed(param) else param.numel()


def _untied_embeddings(model: torch.nn.Module) -> list[torch.nn.Embedding]:
    """Embedding tables only looked up: not shared with another module (our CPU head holds
    the tied table itself) nor behind a head without parameters of its own (TiedHead)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    shared = {
        id(p) for m in model.modules() if not isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
    }
    embeddings = [m for m in embeddings if id(m.weight) not in shared]
    head = getattr(model, "lm_head", None)
    if embeddings and head is not None and next(head.parameters(), None) is None:  # tied: the largest table
        embeddings.remove(max(embeddings, key=lambda m: m.weight.numel()))
    return embeddings


def load_model(model: str) -> torch.nn.Module:
    """Our float32 CPU implementation of ``model`` (weights only, no KV cache)."""
    from conveyor.engine.models.loader import build_model, load_spec

    spec = load_spec(model)
    return build_model(spec, min(spec.max_context, 4096), torch.float32, torch.device("cpu"))


def bounds_for(
    model: str = "smollm2",
    module: torch.nn.Module | None = None,
    gflops: float | None = None,
    read_gbps: float | None = None,
) -> dict:
    """Ceilings for ``model`` on this machine; pass ``module`` (e.g.
    ``llm.engine.runner.model``) and measured limits to skip loading and measuring again."""
    counts = weight_counts(module if module is not None else load_model(model))
    gflops = gflops or matmul_gflops()
    read_gbps = read_gbps or memory_read_gbps()
    return {
        "model": model,
        **counts,
        "matmul_gflops": gflops,
        "read_gbps": read_gbps,
        "decode_tokens_per_s_bound": read_gbps * 1e9 / counts["weight_bytes_per_step"],
        "throughput_tokens_per_s_bound": gflops * 1e9 / (2 * counts["matmul_params"]),
    }


def describe(bounds: dict) -> str:
    return "\n".join(
        [
            f"machine: {bounds['matmul_gflops']:.1f} GFLOP/s float32 matmul, {bounds['read_gbps']:.1f} GB/s "
            f"memory read, {torch.get_num_threads()} torch threads",
            f"{bounds['model']}: {bounds['params'] / 1e6:.1f} M params ({bounds['matmul_params'] / 1e6:.1f} M in "
            f"matmuls), {bounds['weight_bytes_per_step'] / 1e6:.0f} MB read per decode step",
            f"  bandwidth-bound single-stream decode: {bounds['decode_tokens_per_s_bound']:8.1f} tokens/s",
            f"  matmul-bound throughput:              {bounds['throughput_tokens_per_s_bound']:8.1f} tokens/s",
        ]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    add_json_option(parser)
    args = parser.parse_args()
    bounds = bounds_for(args.model)
    print(describe(bounds))
    write_json(args.json, bounds)


if __name__ == "__main__":
    main()
