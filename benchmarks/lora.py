"""LoRA adapters: one batch mixing K adapters vs one adapter at a time, same engine, same run.

    python benchmarks/lora.py [--model smollm2] [--adapters 4] [--per-adapter 4] [--rank 8] [--rounds 3]

K random PEFT-format adapters (rank r on q, k, v, o, gate, up, down) are written to a
temporary folder. Arm "mixed" sends every adapter's prompts in one generate call (steps
batch rows of different adapters: engine/lora/layers.py); arm "serial" sends one call per
adapter, as a server without per-row adapters must. Both are greedy and must produce the
same tokens. Rounds alternate the arms' order, after a warm-up round; prints seconds per
round (min / median / max), the ratio serial / mixed with its spread, the CPU's ISA, and
writes a PNG of the rounds next to the JSON.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, random_prompt  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> str:
    """A PEFT-format adapter of random weights for a Llama-family config."""
    heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, config.intermediate_size),
        "up_proj": (hidden, config.intermediate_size),
        "down_proj": (config.intermediate_size, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in shapes.items():
            where = "self_attn" if target in TARGETS[:4] else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{where}.{target}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
        )
    )
    return str(folder)


def run_round(llm, prompts: list, loras: list, params, mixed: bool) -> tuple[float, list]:
    start = time.perf_counter()
    if mixed:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    else:
        outputs = [None] * len(prompts)
        for adapter in dict.fromkeys(loras):  # one call per adapter, in first-seen order
            indices = [i for i, lora in enumerate(loras) if lora == adapter]
            done = llm.generate([prompts[i] for i in indices], params, use_tqdm=False, lora_request=adapter)
            for i, output in zip(indices, done):
                outputs[i] = output
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--per-adapter", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="auto", help="the engine's (none: float weights)")
    parser.add_argument("--json", default="benchmarks/results/lora.json")
    args = parser.parse_args()
    from conveyor.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(
        args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, quantization=args.quantization
    )
    config = llm.engine.spec.hf_config
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"a{k}", k + 1, write_adapter(Path(tmp) / f"a{k}", config, args.rank, k))
            for k in range(args.adapters)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        times = {"mixed": [], "serial": []}
        import random

        rng = random.Random(0)
        for round_index in range(args.rounds + 1):  # round 0 warms up (and loads every adapter)
            count = args.adapters * args.per_adapter
            prompts = [
                {"prompt_token_ids": random_prompt(rng, args.prompt_len, config.vocab_size)} for _ in range(count)
            ]
            loras = [adapters[i % args.adapters] for i in range(count)]  # interleaved, as a queue brings them
            tokens = {}
            for arm in ("mixed", "serial") if round_index % 2 else ("serial", "mixed"):
                seconds, tokens[arm] = run_round(llm, prompts, loras, params, arm == "mixed")
                if round_index:
                    times[arm].append(seconds)
                print(f"round {round_index} {arm}: {seconds:.2f} s", flush=True)
            assert tokens["mixed"] == tokens["serial"], "both arms must generate the same tokens"
    ratios = [s / m for s, m in zip(times["serial"], times["mixed"])]
    summary = {
        arm: {"seconds_min": min(t), "seconds_median": statistics.median(t), "seconds_max": max(t)}
        for arm, t in times.items()
    }
    summary["serial_over_mixed"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    summary["config"] = {
        **vars(args),
        "cpu": describe_cpu(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "lora_loads": llm.engine.runner.lora.loads,
    }
    print(json.dumps(summary, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2))
    plot(times, ratios, Path(args.json).with_suffix(".png"), args)


def plot(times: dict, ratios: list, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = range(1, len(ratios) + 1)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for arm, marker in (("mixed", "o"), ("serial", "s")):
        axis.plot(rounds, times[arm], marker=marker, label=arm)
    axis.set(
        xlabel="round",
        ylabel="seconds",
        title=f"{args.adapters} adapters x {args.per_adapter} prompts: serial/mixed {statistics.median(ratios):.2f}x",
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
