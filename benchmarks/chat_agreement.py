"""The quality gate that tracks what users see (issue 40): 16 chat questions through SmolLM2's
chat template, 32 greedy tokens each, from float32 (our token-exact path), the default path
(``LLM("smollm2")``: int8 dots on this CPU, bfloat16 KV cache) and llama.cpp on the same GGUF
(node-llama-cpp, benchmarks/peers.py), in one run. The gate: the default's answers agree with
float32 at least as often as llama.cpp's do (answers identical over all tokens; the mean
common prefix is printed beside it), and its GPL-3 perplexity is within 1% of float32's.

    python benchmarks/chat_agreement.py [--tokens 32] [--json chat_agreement.json]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]  # test and benchmark helpers

from chat_questions import chat_prompts  # noqa: E402


def ours(tokens: int, **options) -> tuple[list[list[int]], list[list[int]], float]:
    """The chat prompts, greedy answers and GPL-3 perplexity of one of our paths."""
    from test_int8_quality import CHUNK, CHUNKS, LICENCE, perplexity

    from conveyor.engine import LLM, SamplingParams

    llm = LLM("smollm2", device="cpu", kv_cache_memory="128MiB", seed=0, **options)
    try:
        prompts = chat_prompts(llm.get_tokenizer())
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        answers = [
            o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        ids = llm.get_tokenizer().encode(LICENCE.read_text())
        ppl = perplexity(llm, [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)])
    finally:
        llm.close()
    return prompts, answers, ppl


def llamacpp(prompts: list[list[int]], tokens: int, log_dir: Path) -> list[list[int]]:
    import peers

    from conveyor.engine.models.gguf_import import smollm2_gguf

    home = peers.ensure_llamacpp()
    config = {
        "model": str(smollm2_gguf()),
        "threads": len(peers.usable_cpus()),
        "context_size": 1024,
        "max_sequences": 1,
    }
    worker = peers.Worker(
        "llamacpp", ["node", "peers_llamacpp.mjs", json.dumps(config)], log_dir / "llamacpp.log", cwd=home
    )
    try:
        worker.reply(peers.LOAD_TIMEOUT_S)
        return [
            worker.request({"op": "run", "prompts": [p], "output_lens": [tokens], "keep_tokens": True})["token_ids"][0]
            for p in prompts
        ]
    finally:
        worker.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    prefixes = [common_prefix(a, r) for a, r in zip(answers, reference)]
    return {
        "identical": sum(a == r for a, r in zip(answers, reference)),
        "mean_common_prefix": statistics.mean(prefixes),
        "prefixes": prefixes,
    }


def main() -> None:
    from harness import add_json_option, describe_cpu, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    add_json_option(parser)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    prompts, float32, ppl_float32 = ours(args.tokens, dtype="float32")
    _, default, ppl_default = ours(args.tokens)
    with tempfile.TemporaryDirectory() as logs:
        peer = llamacpp(prompts, args.tokens, Path(logs))
    results = {
        "default vs float32": agreement(default, float32),
        "llama.cpp vs float32": agreement(peer, float32),
        "perplexity": {"float32": ppl_float32, "default": ppl_default, "ratio": ppl_default / ppl_float32},
    }
    for name in ("default vs float32", "llama.cpp vs float32"):
        row = results[name]
        print(
            f"{name:<22} {row['identical']:>2}/16 identical, mean common prefix {row['mean_common_prefix']:.1f}"
            f" of {args.tokens}  {row['prefixes']}"
        )
    ours_row, peer_row = results["default vs float32"], results["llama.cpp vs float32"]
    agrees = ours_row["identical"] >= peer_row["identical"]
    ratio = results["perplexity"]["ratio"]
    results["gate"] = bool(agrees and abs(ratio - 1) < 0.01)
    print(f"GPL-3 perplexity default/float32: {ratio:.4f}")
    print(f"gate (identical answers >= llama.cpp's, perplexity within 1%): {'PASS' if results['gate'] else 'FAIL'}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
