"""Parallel sampling: one request with ``n`` samples vs ``n`` separate requests, same run.

    python benchmarks/parallel_sampling.py [--model smollm2] [--n 4] [--prompt-len 512] [--rounds 3]

Both arms produce the same tokens: sample i of the n-request uses seed + i, which is what
the i-th separate request is given. Rounds alternate arms, each round with a fresh random
prompt (so no arm finds another round's prompt cached); each arm has its own engine.
Prints seconds per round (min / median / max), prompt positions computed, and the ratio.
"""

import argparse
import json
import random
import statistics
import time

import torch


def prompt_positions_computed(llm) -> int:
    manager = llm.engine.scheduler.block_manager
    return manager.prefix_queries - manager.prefix_hits


def run_round(llm, prompt, args, together: bool) -> tuple[float, list[list[int]], int]:
    from conveyor.engine import SamplingParams

    base = dict(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True)
    before = prompt_positions_computed(llm)
    start = time.perf_counter()
    if together:
        outputs = llm.generate([prompt], SamplingParams(n=args.n, seed=args.seed, **base), use_tqdm=False)[0].outputs
    else:
        params = [SamplingParams(seed=args.seed + i, **base) for i in range(args.n)]
        outputs = [o.outputs[0] for o in llm.generate([prompt] * args.n, params, use_tqdm=False)]
    return time.perf_counter() - start, [o.token_ids for o in outputs], prompt_positions_computed(llm) - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    from conveyor.engine import LLM

    engines = {arm: LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens) for arm in ("n", "separate")}
    vocab = engines["n"].engine.spec.hf_config.vocab_size
    rng = random.Random(args.seed)
    times = {arm: [] for arm in engines}
    computed = {arm: [] for arm in engines}
    for round_index in range(args.rounds + 1):  # round 0 warms both up
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        tokens = {}
        for arm in ("n", "separate") if round_index % 2 else ("separate", "n"):
            seconds, tokens[arm], positions = run_round(engines[arm], prompt, args, together=arm == "n")
            if round_index:
                times[arm].append(seconds)
                computed[arm].append(positions)
        assert tokens["n"] == tokens["separate"], "both arms must sample the same tokens"
    summary = {
        arm: {
            "seconds_min": min(t),
            "seconds_median": statistics.median(t),
            "seconds_max": max(t),
            "prompt_positions_per_round": computed[arm][0],
        }
        for arm, t in times.items()
    }
    summary["speedup_median"] = summary["separate"]["seconds_median"] / summary["n"]["seconds_median"]
    summary["config"] = {
        **vars(args),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
