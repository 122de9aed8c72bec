"""Perplexity of ours and of llama.cpp on the same GGUF and the same tokens (the quality
gate's second half in issue 27: "no worse than llama.cpp on the same GGUF").

    python benchmarks/peer_perplexity.py [--chunks 2] [--chunk 512] [--text /usr/share/common-licenses/GPL-3]

The text is tokenized once by our tokenizer (the GGUF's vocabulary); each chunk is scored
from its start, token j + 1 given tokens 0..j, by: ours with dtype="float32" (float32 copy)
and dtype="auto" (what this CPU's default takes: int8 dots on AVX2/AVX512-VNNI), through
``prompt_logprobs``; and llama.cpp (node-llama-cpp, benchmarks/llamacpp_perplexity.mjs),
through the full next-token distribution. Prints the CPU and the three perplexities.
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def load_ours(dtype: str):
    from conveyor.engine import LLM

    return LLM("smollm2", dtype=dtype, device="cpu", kv_cache_memory="128MiB", seed=0)


def ours(chunks: list[list[int]], llm) -> float:
    from conveyor.engine import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    logprobs = [e[t].logprob for o, c in zip(outputs, chunks) for e, t in zip(o.prompt_logprobs[1:], c[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def llamacpp(chunks: list[list[int]], gguf: Path) -> float:
    from peers import ensure_llamacpp

    home = ensure_llamacpp()
    shutil.copyfile(HERE / "llamacpp_perplexity.mjs", home / "llamacpp_perplexity.mjs")
    request = json.dumps({"model": str(gguf), "chunks": chunks})
    run = subprocess.run(
        ["node", "llamacpp_perplexity.mjs"], input=request, capture_output=True, text=True, cwd=home, check=True
    )
    line = next(line for line in run.stdout.splitlines() if line.startswith("@@PPL "))
    result = json.loads(line[len("@@PPL ") :])
    return math.exp(result["nll"] / result["tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()

    from harness import describe_cpu

    from conveyor.engine.models.gguf_import import smollm2_gguf

    print(describe_cpu(), flush=True)
    float32 = load_ours("float32")
    ids = float32.get_tokenizer().encode(Path(args.text).read_text())
    chunks = [ids[i * args.chunk : (i + 1) * args.chunk] for i in range(args.chunks)]
    print(f"{Path(args.text).name}: {args.chunks} x {args.chunk} tokens", flush=True)
    figures = {"float32": ours(chunks, float32)}
    del float32
    figures["auto"] = ours(chunks, load_ours("auto"))
    figures["llama.cpp"] = llamacpp(chunks, smollm2_gguf())
    for name, value in figures.items():
        print(f"perplexity {name:>10}: {value:.4f} ({100 * (value / figures['float32'] - 1):+.2f}% vs our float32)")


if __name__ == "__main__":
    main()
