"""Where int8 activations' greedy disagreement comes from (docs/performance.md): int8 with 16
sequences per step vs one at a time, and torch's float32 with every linear's activations
fake-quantized per 32-block (as the kernel) vs float32, on SmolLM2 and 16 Apache-2.0 prompts.
Then activations quantized per token (one scale a row, what oneDNN's int8 matmul takes,
``torch.ops.onednn.qlinear_pointwise``: 1.4-1.7x its bf16 matmul at 64 rows,
benchmarks/gguf_layers.py) against per 32-block: GPL-3 perplexity and greedy agreement."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from test_int8_dot import quantize_activations  # noqa: E402
from test_int8_quality import CHUNK, CHUNKS, LICENCE, TOKENS, common_prefix, perplexity, prompts  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402
from conveyor.kernels.cpu import dispatch  # noqa: E402
from conveyor.kernels.cpu.linear import CpuLinear  # noqa: E402


def engine(quantization: str, seqs: int, fake_quant: bool = False) -> LLM:
    options = dict(dtype="float32", device="cpu", kv_cache_memory="128MiB", seed=0, max_num_seqs=seqs)
    llm = LLM("smollm2", quantization=quantization, **options)
    if fake_quant:
        llm.engine.runner.backend.decoder = False  # the compiled decoder would bypass the layers
    return llm


def greedy_of(llm: LLM, texts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(texts, params, use_tqdm=False)]


def greedy(quantization: str, seqs: int, texts: list[str], fake_quant: bool = False) -> list[list[int]]:
    return greedy_of(engine(quantization, seqs, fake_quant), texts)


def per_token(x):
    """One int8 scale per row (symmetric, max|x| / 127), as oneDNN's int8 matmul takes x."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale) * scale


def per_block(x):
    q, d = quantize_activations(x.contiguous())
    return (q * d).reshape(x.shape)


def report(name: str, a: list[list[int]], b: list[list[int]]) -> None:
    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    print(f"{name}: {sum(p == TOKENS for p in prefixes)} of {len(a)} identical, prefixes {prefixes}", flush=True)


def main() -> None:
    dispatch.set_int8_max_rows(1 << 30)  # integer dots on every step, as the quality gate
    texts = prompts()
    int8_batched, int8_single = greedy("gguf_int8", 16, texts), greedy("gguf_int8", 1, texts)
    reference = greedy("none", 16, texts)
    forward = CpuLinear.forward

    float32 = engine("none", 16)
    ids = float32.get_tokenizer().encode(LICENCE.read_text())
    chunks = [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)]
    reference_ppl = perplexity(float32, chunks)
    fakes = {}
    for name, quantize in (("per 32-block", per_block), ("per token", per_token)):
        CpuLinear.forward = lambda self, x, quantize=quantize: forward(self, quantize(x))
        llm = engine("none", 16, fake_quant=True)
        fakes[name] = greedy_of(llm, texts)
        ppl = perplexity(llm, chunks)
        CpuLinear.forward = forward
        print(
            f"GPL-3 perplexity, activations fake-quantized {name}: {ppl:.4f} vs float32 {reference_ppl:.4f} "
            f"({100 * (ppl / reference_ppl - 1):+.2f}%)",
            flush=True,
        )
    report("int8 16 rows vs int8 1 row", int8_batched, int8_single)
    report("int8 vs float32", int8_batched, reference)
    for name, fake in fakes.items():
        report(f"float32, activations fake-quantized {name}, vs float32", fake, reference)
    report("int8 vs fake-quantized per 32-block", int8_batched, fakes["per 32-block"])


if __name__ == "__main__":
    main()
