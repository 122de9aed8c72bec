"""Tokens/s of a tiny dense model and a tiny mixture of experts in each parallel mode the
engine has (tensor, expert, pipeline, and pipeline x tensor/expert) at 1, 2 (and 4) ranks,
with the time rank 0 spends communicating per step.

    python benchmarks/parallel_modes.py [--ranks 1,2,4] [--requests 16] [--max-tokens 64] [--hidden 256]

Both models are random, built here from transformers' config classes (a Llama and a
Qwen3-MoE of the same width and depth, 8 experts, top-2), run in float32 by the offline
``LLM`` with gloo ranks on this machine. Each configuration runs the same greedy batch
twice (the first warms up) and reports the second: output tokens/s, the steps, the
all-reduces and the seconds rank 0 spent in them, and under pipeline parallel the bytes
handed from stage to stage and the seconds rank 0 waited for the last stage (the other
stages' compute and the hand-offs: with P steps in flight, only what stage 0's own work did
not cover). On a box with fewer cores than ranks the ranks share cores: read the
communication columns, not the speed-up.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_cpu, write_json  # noqa: E402


def build_models(folder: Path, hidden: int, layers: int) -> dict[str, str]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    vocab = {chr(33 + i): i for i in range(90)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="!")), unk_token="!", eos_token='"'
    )
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    common = dict(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    built = {}
    for name, config, cls in (
        ("dense", LlamaConfig(**common, intermediate_size=4 * hidden), LlamaForCausalLM),
        (
            "moe",
            Qwen3MoeConfig(
                **common,
                intermediate_size=4 * hidden,
                moe_intermediate_size=hidden,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                head_dim=hidden // 8,
            ),
            Qwen3MoeForCausalLM,
        ),
    ):
        torch.manual_seed(0)
        out = folder / name
        cls(config).to(torch.float32).save_pretrained(out)
        tokenizer.save_pretrained(out)
        built[name] = str(out)
    return built


# (model, mode, tensor ranks, pipeline stages); expert parallel is the MoE's tensor split
MODES = [
    ("dense", "one rank", 1, 1),
    ("dense", "tensor", 2, 1),
    ("dense", "pipeline", 1, 2),
    ("dense", "tensor", 4, 1),
    ("dense", "pipeline", 1, 4),
    ("dense", "pipeline x tensor", 2, 2),
    ("moe", "one rank", 1, 1),
    ("moe", "expert", 2, 1),
    ("moe", "pipeline", 1, 2),
    ("moe", "expert", 4, 1),
    ("moe", "pipeline x expert", 2, 2),
]


def measure(model: str, tp: int, pp: int, args) -> dict:
    from conveyor.engine import LLM, SamplingParams

    options = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32")
    if "moe" in model and tp > 1:
        options["enable_expert_parallel"] = True
    llm = LLM(model, **options)
    try:
        prompts = [[2 + (i * 7 + j) % 80 for j in range(48)] for i in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        before = llm.engine.stats()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        after = llm.engine.stats()
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outputs)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "steps": delta("num_steps"),
        "all_reduces": delta("tp_num_all_reduces"),
        "all_reduce_s": delta("tp_all_reduce_s"),
        "bytes_handed_on": delta("pp_bytes_handed_on"),
        "stage_wait_s": delta("pp_wait_s"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2", help="world sizes to run (tensor x pipeline ranks)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of tokens/s by mode and ranks (matplotlib)")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="conveyor-parallel-") as folder:
        models = build_models(Path(folder), args.hidden, args.layers)
        for name, mode, tp, pp in MODES:
            if tp * pp not in ranks:
                continue
            row = {"model": name, "mode": mode, "tensor": tp, "stages": pp, "ranks": tp * pp}
            row.update(measure(models[name], tp, pp, args))
            rows.append(row)
            steps = max(row["steps"], 1)
            print(
                f"{name:>5} {mode:>17} x{tp * pp} (tp {tp}, pp {pp}): {row['tokens_per_s']:7.1f} tok/s, "
                f"{row['steps']} steps; per step: {row['all_reduces'] / steps:.0f} all-reduces "
                f"{1e3 * row['all_reduce_s'] / steps:.2f} ms, {row['bytes_handed_on'] / steps / 1024:.0f} KiB handed on, "
                f"{1e3 * row['stage_wait_s'] / steps:.2f} ms waiting on later stages",
                flush=True,
            )
    print(
        f"\n{describe_cpu()}, {os.cpu_count()} cores\n{args.requests} requests x {args.max_tokens} tokens, hidden {args.hidden}, {args.layers} layers"
    )
    write_json(args.json, {"cpu": describe_cpu(), "rows": rows})
    if args.plot:
        plot(rows, f"{describe_cpu()}\nhidden {args.hidden}, {args.layers} layers", args.plot)


def plot(rows: list[dict], title: str, path: str) -> None:
    """Bars of tokens/s, one per configuration, each model beside the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, model in zip(axes, ("dense", "moe")):
        mine = [row for row in rows if row["model"] == model]
        labels = [f"{row['mode']}\nx{row['ranks']}" for row in mine]
        ax.bar(range(len(mine)), [row["tokens_per_s"] for row in mine], color="tab:blue")
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_title(f"{model}: output tokens/s", fontsize=9)
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
