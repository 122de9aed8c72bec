"""The device check for the Triton backend: one run on one GPU (sized for an H200 in under
10 minutes), with PyTorch, Triton and transformers preinstalled and nothing downloaded.

    python benchmarks/gpu_check.py [--rounds 3] [--json gpu_check.json] [--plot gpu_check.png]
    python benchmarks/gpu_check.py --cpu-dry-run   # CI: the same code, tiny, under Triton's interpreter

1. kernels: each Triton kernel (kernels/triton/) against the torch reference at real shapes
   (head sizes 64/128, GQA 4/8, float32/bfloat16/float16), max error vs its tolerance;
2. exactness: the tiny Llama, Qwen2 and Qwen3 of tests/model_factory.py in float32 on the
   device, greedy token-identical to transformers: Triton with CUDA graphs, Triton eager
   (``enforce_eager``), and the torch reference backend;
3. speed: a random-initialised model of Llama-3.2-1B's shapes in bfloat16 (written locally,
   tiny tokenizer), ours with CUDA graphs on and off against transformers ``generate`` on
   the same GPU, in alternating rounds: single-stream decode, 64 concurrent requests and
   the mixed workload of benchmarks/offline.py; ratios as median (min-max); single-stream
   as a fraction of the HBM bound (bytes read per token / measured copy bandwidth).
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]  # test and benchmark helpers

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
FULL = dict(
    kernel_shapes=4,
    graphs=True,
    kernel_tokens=512,
    exact_prompts=6,
    exact_tokens=24,
    speed_model=LLAMA_1B,
    single_tokens=128,
    concurrent=64,
    concurrent_tokens=128,
    mixed_requests=32,
    prompt_tokens=128,
)
DRY = dict(
    kernel_shapes=1,
    graphs=False,
    kernel_tokens=20,
    exact_prompts=1,
    exact_tokens=3,
    speed_model=None,
    single_tokens=3,
    concurrent=2,
    concurrent_tokens=2,
    mixed_requests=2,
    prompt_tokens=8,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (what CI runs)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating speed rounds")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--plot", default=None, help="a PNG of the speed ratios (e.g. gpu_check.png)")
    args = parser.parse_args()
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch
    from harness import describe_cpu, write_json

    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    sizes = DRY if args.cpu_dry_run else FULL
    print(environment(torch, device), describe_cpu(), sep="\n", flush=True)
    started = time.perf_counter()
    results = {"kernels": check_kernels(device, sizes)}
    print(f"[{time.perf_counter() - started:.0f} s] kernels checked", flush=True)
    results["exactness"] = check_exactness(device, sizes)
    print(f"[{time.perf_counter() - started:.0f} s] exactness checked", flush=True)
    results["speed"] = check_speed(device, sizes, 1 if args.cpu_dry_run else args.rounds, args.plot)
    print(f"[{time.perf_counter() - started:.0f} s] speed measured", flush=True)
    write_json(args.json, results)
    failed = [row["name"] for row in results["kernels"] if not row["ok"]] + [
        row["case"] for row in results["exactness"] if not row["ok"]
    ]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed", flush=True)
    sys.exit(1 if failed else 0)


def environment(torch, device) -> str:
    import transformers
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return f"device: {where}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"


# ---- 1. kernels ------------------------------------------------------------------------
# on max |got - want| / (1 + |want|), want in float32 from the same inputs
TOLERANCE = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}


def check_kernels(device, sizes: dict) -> list[dict]:
    import torch

    rows = []
    shapes = [(4, 64, torch.bfloat16), (8, 128, torch.float16), (4, 128, torch.float32), (8, 64, torch.bfloat16)]
    for group, head_dim, dtype in shapes[: sizes["kernel_shapes"]]:
        for name, error in kernel_errors(device, sizes["kernel_tokens"], group, head_dim, dtype).items():
            tol = TOLERANCE[str(dtype).removeprefix("torch.")]
            rows.append(
                {
                    "name": f"{name} g{group} d{head_dim} {str(dtype)[6:]}",
                    "max_error": error,
                    "tolerance": tol,
                    "ok": error <= tol,
                }
            )
    rows.append(sampling_check(device))
    for row in rows:
        print(
            f"kernel {row['name']:<34} max error {row['max_error']:.2e} (tolerance {row['tolerance']:.0e})"
            f" {'ok' if row['ok'] else 'FAILED'}",
            flush=True,
        )
    return rows


def kernel_errors(device, tokens: int, group: int, head_dim: int, dtype) -> dict:
    import torch

    from conveyor.kernels import attention as ref
    from conveyor.kernels import layer_ops
    from conveyor.kernels.triton import cache_write, decode_attention, prefill_attention
    from conveyor.kernels.triton import layer_ops as fused

    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    kv_heads, block_size = 2, 16
    lengths = [1, 17, tokens // 2 + 3, tokens]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 1
    k_cache, v_cache = (
        rand(kv_heads, num_blocks, block_size, head_dim),
        rand(kv_heads, num_blocks, block_size, head_dim),
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used : used + -(-n // block_size)])
        used += len(tables[-1])
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    context = torch.tensor(lengths, device=device)
    query, scale = rand(len(lengths), kv_heads * group, head_dim), head_dim**-0.5
    f32 = lambda t: t.float()  # noqa: E731
    rel = lambda got, want: ((got.float() - want) / (1 + want.abs())).abs().max().item()  # noqa: E731
    errors = {}
    want = ref.paged_decode_attention_reference(f32(query), f32(k_cache), f32(v_cache), block_tables, context, scale)
    for splits in (1, 4):
        got = decode_attention.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context, scale, num_splits=splits
        )
        errors[f"decode splits={splits}"] = rel(got, want)
    prefix, new = lengths[2] - 7, 7
    q = rand(new, kv_heads * group, head_dim)
    out = torch.zeros_like(q)
    table = block_tables[2:3]
    prefill_attention.prefill_attention_varlen(
        q,
        k_cache,
        v_cache,
        out,
        torch.tensor([0], device=device),
        torch.tensor([new], device=device),
        torch.tensor([prefix], device=device),
        table,
        new,
        scale,
        exact=dtype == torch.float32,
    )
    positions = range(prefix, prefix + new)
    slots = torch.tensor([tables[2][p // block_size] * block_size + p % block_size for p in positions], device=device)
    k_new = k_cache.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)
    v_new = v_cache.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)
    want = ref.prefill_attention(f32(q), f32(k_new), f32(v_new), f32(k_cache), f32(v_cache), table[0], prefix, scale)
    errors["prefill varlen"] = rel(out, want)
    key, value = rand(new, kv_heads, head_dim), rand(new, kv_heads, head_dim)
    got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(key, value, want_k, want_v, slots)
    cache_write.write_kv_cache(key, value, got_k, got_v, slots)
    errors["cache write"] = max((got_k - want_k).abs().max().item(), (got_v - want_v).abs().max().item())
    x, residual, weight = rand(tokens, 512), rand(tokens, 512), rand(512)
    normed, _ = fused.add_rms_norm(x, residual, weight, 1e-5)
    errors["add+rmsnorm"] = rel(normed, layer_ops.rms_norm_reference(f32(residual + x), f32(weight), 1e-5))
    gate_up = rand(tokens, 1024)
    gate, up = f32(gate_up).chunk(2, dim=-1)
    errors["silu-and-mul"] = rel(fused.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    cos = torch.cat([rand(tokens, head_dim // 2)] * 2, dim=-1)
    sin = torch.cat([rand(tokens, head_dim // 2)] * 2, dim=-1)
    heads = rand(tokens, kv_heads * group, head_dim)
    want, _ = layer_ops.apply_rotary(f32(heads), f32(heads), (f32(cos)[:, None], f32(sin)[:, None]))
    errors["rotary"] = rel(fused.rotary_(heads.clone(), cos, sin), want)
    errors["fused moe"] = moe_error(device, tokens, rand, f32, rel)
    return errors


def moe_error(device, tokens: int, rand, f32, rel) -> float:
    """kernels/triton/moe.py's grouped GEMMs (8 experts, top-2) against one GEMM per expert."""
    import torch

    from conveyor.kernels.moe import experts_reference
    from conveyor.kernels.triton.moe import fused_experts

    # seeded like the other inputs; small weights: the intermediate is rounded to the dtype, as a
    # GPU's would be (bfloat16's worst here was 3e-3 of its 3e-2 tolerance over 6 seeds)
    x, gate_up, down = rand(tokens, 128), rand(8, 2 * 128, 128) * 0.05, rand(8, 128, 128) * 0.05
    weights, ids = torch.topk(rand(tokens, 8).float().softmax(-1), 2, dim=-1)
    want = experts_reference(f32(x), f32(gate_up), f32(down), weights, ids)
    return rel(fused_experts(x, gate_up, down, weights.to(x.dtype), ids), want)


def sampling_check(device) -> dict:
    import torch

    from conveyor.kernels.sampling import apply_top_k_top_p_min_p, sample_with_noise
    from conveyor.kernels.triton import sampling

    gen = torch.Generator(device="cpu").manual_seed(1)
    vocab = 512 if device.type == "cpu" else 128256
    logits = (3 * torch.randn(8, vocab, generator=gen)).to(device)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 1.0, 0.9, 1.1], device=device)
    top_k = torch.tensor([0, 5, 0, 50, 1, 20, 0, 100], device=device)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.7, 0.95, 1.0], device=device)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.2, 0.0, 0.1], device=device)
    noise = torch.empty(8, vocab).exponential_(generator=gen).to(device)
    got = sampling.sample(logits, temperature, top_k, top_p, min_p, noise)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    probs = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p).softmax(-1)
    want = torch.where(temperature == 0, logits.argmax(-1), sample_with_noise(probs, noise))
    mismatches = int((got != want).sum())
    return {"name": "sampling ids", "max_error": float(mismatches), "tolerance": 0.0, "ok": mismatches == 0}


# ---- 2. exactness ----------------------------------------------------------------------
def check_exactness(device, sizes: dict) -> list[dict]:
    from model_factory import build_tiny_model, hf_greedy, mixed_prompts

    from conveyor.engine import LLM, SamplingParams

    variants = {
        "triton+graphs": dict(attention_backend="triton"),
        "triton eager": dict(attention_backend="triton", enforce_eager=True),
        "torch": dict(attention_backend="torch"),
    }
    if not sizes["graphs"]:  # CPU: no graphs to capture, the first variant would be the second
        del variants["triton+graphs"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for arch in ("llama", "qwen2", "qwen3"):
            model = build_tiny_model(arch, Path(scratch) / arch)
            prompts = mixed_prompts(768, n=sizes["exact_prompts"], seed=5, min_len=1, max_len=60)
            want = [hf_greedy(model, p, sizes["exact_tokens"]) for p in prompts]
            for name, options in variants.items():
                llm = LLM(model, device=device.type, dtype="float32", num_kv_blocks=256, **options)
                params = SamplingParams(temperature=0, max_tokens=sizes["exact_tokens"])
                got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                same = sum(g == w for g, w in zip(got, want))
                rows.append(
                    {"case": f"{arch} {name}", "identical": same, "of": len(prompts), "ok": same == len(prompts)}
                )
                print(
                    f"exactness {arch:<6} {name:<14} {same}/{len(prompts)} token-identical to transformers", flush=True
                )
                del llm
    return rows


# ---- 3. speed --------------------------------------------------------------------------
def check_speed(device, sizes: dict, rounds: int, plot: str | None) -> dict:
    """Ratios are transformers' time over ours for the same requests (> 1: ours is faster)."""
    from model_factory import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        if sizes["speed_model"] is None:
            model, dtype = build_tiny_model("llama", Path(scratch) / "speed"), "float32"
        else:
            print("writing a random Llama-3.2-1B-shaped model ...", flush=True)
            model, dtype = build_tiny_model("llama3", Path(scratch) / "speed", **sizes["speed_model"]), "bfloat16"
        workloads = make_workloads(sizes)
        runners = {
            "graphs": ours(model, device, dtype, {}),
            "eager": ours(model, device, dtype, {"enforce_eager": True}),
            "transformers": transformers_runner(model, device, dtype),
        }
        times = timed_rounds(workloads, runners, rounds)
        ratios = {
            (w, name): [hf / t for hf, t in zip(times[w, "transformers"], times[w, name])]
            for w in workloads
            for name in ("graphs", "eager")
        }
        summary = {f"{w} {name} vs transformers": spread(r) for (w, name), r in ratios.items()}
        for w, (_, lens) in workloads.items():
            summary[f"{w} tokens/s graphs"] = sum(lens) / statistics.median(times[w, "graphs"])
        summary["graphs vs eager (single)"] = spread(
            [e / g for e, g in zip(times["single", "eager"], times["single", "graphs"])]
        )
        if device.type == "cuda":
            summary["single HBM-bound fraction"] = hbm_fraction(model, summary["single tokens/s graphs"], device)
    for key, value in summary.items():
        print(f"speed {key}: {value if isinstance(value, str) else f'{value:.3f}'}", flush=True)
    if plot:
        plot_ratios(ratios, plot)
    return summary


def timed_rounds(workloads: dict, runners: dict, rounds: int) -> dict:
    """Seconds per (workload, runner), every runner once per round, in turn, after one
    uncounted warm-up round (on an H100 the first round took transformers 5x its later
    ones: kernel selection and allocator growth, not the steady state)."""
    times = {(w, r): [] for w in workloads for r in runners}
    for workload, (prompts, lens) in workloads.items():
        for run in runners.values():
            run(prompts, lens)
    for index in range(rounds):
        for workload, (prompts, lens) in workloads.items():
            for name, run in runners.items():
                times[workload, name].append(run(prompts, lens))
                print(f"round {index + 1} {workload:<10} {name:<12} {times[workload, name][-1]:.3f} s", flush=True)
    return times


def plot_ratios(ratios: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({w for w, _ in ratios}, key=["single", "concurrent", "mixed"].index)
    figure, axes = plt.subplots(figsize=(7, 4))
    for offset, name in ((-0.2, "graphs"), (0.2, "eager")):
        medians = [statistics.median(ratios[w, name]) for w in workloads]
        low = [m - min(ratios[w, name]) for m, w in zip(medians, workloads)]
        high = [max(ratios[w, name]) - m for m, w in zip(medians, workloads)]
        axes.bar([i + offset for i in range(len(workloads))], medians, 0.4, yerr=[low, high], label=f"ours, {name}")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(workloads)), workloads)
    axes.set_ylabel("transformers time / ours (median, min-max)")
    axes.set_title("Conveyor Triton backend vs transformers generate, same GPU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def make_workloads(sizes: dict) -> dict:
    from offline import make_workload

    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, 768) for _ in range(n)]  # noqa: E731 (the tiny tokenizer's ids)
    mixed_prompts, mixed_lens = make_workload(sizes["mixed_requests"], 768)
    if sizes["speed_model"] is None:  # dry run: short
        mixed_prompts, mixed_lens = [p[:8] for p in mixed_prompts], [2] * len(mixed_lens)
    return {
        "single": ([prompt(sizes["prompt_tokens"])], [sizes["single_tokens"]]),
        "concurrent": (
            [prompt(sizes["prompt_tokens"]) for _ in range(sizes["concurrent"])],
            [sizes["concurrent_tokens"]] * sizes["concurrent"],
        ),
        "mixed": (mixed_prompts, mixed_lens),
    }


def ours(model: str, device, dtype: str, options: dict):
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, device=device.type, dtype=dtype, attention_backend="triton", max_model_len=1024, **options)

    def run(prompts, lens) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        synchronize(device)
        assert [len(o.token_ids) for o in outputs] == lens
        return time.perf_counter() - start

    run(*make_warmup())
    return run


def transformers_runner(model: str, device, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()

    def run(prompts, lens) -> float:
        """Static batches of up to 64 in order, left-padded, each to its longest output."""
        synchronize(device)
        start = time.perf_counter()
        for first in range(0, len(prompts), 64):
            batch, new = prompts[first : first + 64], max(lens[first : first + 64])
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
        synchronize(device)
        return time.perf_counter() - start

    run(*make_warmup())
    return run


def make_warmup():
    return [[101, 102, 103]], [2]


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_fraction(model: str, tokens_per_s: float, device) -> str:
    """Single-stream decode reads every weight once per token (KV reads are small beside
    them at 128 + 128 tokens): achieved bytes/s over a measured device copy's bandwidth."""
    import torch
    from safetensors import safe_open

    weight_bytes = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            weight_bytes += 2 * sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())  # as bfloat16
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    synchronize(device)
    bandwidth = 2 * 10 * source.numel() / (time.perf_counter() - start)  # read + write
    achieved = tokens_per_s * weight_bytes
    return f"{achieved / bandwidth:.2f} ({achieved / 1e9:.0f} GB/s of {bandwidth / 1e9:.0f} GB/s measured copy)"


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


if __name__ == "__main__":
    main()
