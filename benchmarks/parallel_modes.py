"""Tokens/s of a tiny dense model under tensor parallel and a tiny mixture of experts under
expert parallel, at 1, 2 (and 4) ranks, with the time rank 0 spends in all-reduces.

    python benchmarks/parallel_modes.py [--ranks 1,2] [--requests 16] [--max-tokens 64] [--hidden 256]

Both models are random, built here from transformers' config classes (a Llama and a
Qwen3-MoE of the same width and depth, 8 experts, top-2), run in float32 by the offline
``LLM`` with gloo ranks on this machine. Each configuration runs the same greedy batch
twice (the first warms up) and reports the second: output tokens/s, the all-reduces and the
seconds rank 0 spent in them, and their share of the wall time. On a box with fewer cores than ranks
the ranks share cores: read the communication column, not the speed-up.
"""

import argparse
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


def measure(model: str, ranks: int, expert_parallel: bool, args) -> dict:
    from conveyor.engine import LLM, SamplingParams

    options = dict(tensor_parallel_size=ranks, dtype="float32")
    if expert_parallel and ranks > 1:
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
    reduces = after.get("tp_num_all_reduces", 0) - before.get("tp_num_all_reduces", 0)
    reduce_s = after.get("tp_all_reduce_s", 0.0) - before.get("tp_all_reduce_s", 0.0)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "all_reduces": reduces, "all_reduce_s": reduce_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="conveyor-parallel-") as folder:
        models = build_models(Path(folder), args.hidden, args.layers)
        for name, expert_parallel in (("dense", False), ("moe", True)):
            for n in ranks:
                row = {"model": name, "ranks": n, "mode": "expert" if expert_parallel else "tensor"}
                row.update(measure(models[name], n, expert_parallel, args))
                rows.append(row)
                print(
                    f"{name:>5} {row['mode']:>6} parallel x{n}: {row['tokens_per_s']:7.1f} tok/s, "
                    f"{row['all_reduces']} all-reduces, {row['all_reduce_s']:.2f} s in them "
                    f"({100 * row['all_reduce_s'] / row['wall_s']:.0f}% of {row['wall_s']:.1f} s)",
                    flush=True,
                )
    print(
        f"\n{describe_cpu()}\n{args.requests} requests x {args.max_tokens} tokens, hidden {args.hidden}, {args.layers} layers"
    )
    write_json(args.json, {"cpu": describe_cpu(), "rows": rows})


if __name__ == "__main__":
    main()
