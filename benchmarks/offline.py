"""Offline throughput: our ``LLM`` vs transformers ``generate`` in static batches, same run.

    python benchmarks/offline.py [--model smollm2] [--num-requests 32] [--hf-batch-sizes 8 32]

Workload: prompts of 32-256 random tokens, outputs of 16-128 tokens, ignore_eos (fixed
lengths), float32 on CPU. Prints useful output tokens/s of each and the ratio.
"""

import argparse
import json
import random
import time

import torch


def make_workload(num_requests: int, vocab_size: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 256))] for _ in range(num_requests)]
    output_lens = [rng.randint(16, 128) for _ in range(num_requests)]
    return prompts, output_lens


def run_ours(model: str, prompts, output_lens, **options) -> dict:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, **options)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == sum(output_lens), "ignore_eos outputs must have exactly max_tokens tokens"
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "preemptions": llm.engine.scheduler.num_preemptions,
    }


def run_transformers(model_dir, prompts, output_lens, batch_size: int) -> dict:
    """Static batches in arrival order, left-padded; a batch runs to its longest output.
    Only tokens each request asked for count as useful."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = hf.generation_config.pad_token_id or 0
    _hf_generate(hf, prompts[:2], 4, pad_id)  # warm-up
    start = time.perf_counter()
    for first in tqdm(range(0, len(prompts), batch_size), desc=f"transformers bs={batch_size}"):
        batch = prompts[first : first + batch_size]
        _hf_generate(hf, batch, max(output_lens[first : first + batch_size]), pad_id)
    elapsed = time.perf_counter() - start
    tokens = sum(output_lens)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def _hf_generate(hf, batch, max_new_tokens: int, pad_id: int):
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        return hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from conveyor.engine.models.loader import load_spec

    spec = load_spec(args.model)
    prompts, output_lens = make_workload(args.num_requests, spec.hf_config.vocab_size)
    results = {
        "ours": run_ours(
            args.model,
            prompts,
            output_lens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    }
    for batch_size in args.hf_batch_sizes:
        results[f"transformers_bs{batch_size}"] = run_transformers(spec.model_dir, prompts, output_lens, batch_size)
    ours = results["ours"]["tokens_per_s"]
    print(
        f"\nworkload: {args.num_requests} requests, prompts 32-256, outputs 16-128 tokens "
        f"({sum(output_lens)} output tokens), {args.model}, float32, {torch.get_num_threads()} threads"
    )
    for name, result in results.items():
        ratio = ours / result["tokens_per_s"]
        print(
            f"{name:>20}: {result['tokens_per_s']:8.1f} output tok/s  {result['seconds']:7.1f} s"
            + ("" if name == "ours" else f"   ours / this = {ratio:.2f}x")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
