"""Where int8 activations' greedy disagreement comes from (docs/performance.md): int8 with 16
sequences per step vs one at a time, and torch's float32 with every linear's activations
fake-quantized per 32-block (as the kernel) vs float32, on SmolLM2 and 16 Apache-2.0 prompts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from test_int8_dot import quantize_activations  # noqa: E402
from test_int8_quality import TOKENS, common_prefix, prompts  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from kernels.cpu import dispatch  # noqa: E402
from kernels.cpu.linear import CpuLinear  # noqa: E402


def greedy(quantization: str, seqs: int, texts: list[str], fake_quant: bool = False) -> list[list[int]]:
    options = dict(dtype="float32", device="cpu", kv_cache_memory="128MiB", seed=0, max_num_seqs=seqs)
    llm = LLM("smollm2", quantization=quantization, **options)
    if fake_quant:
        llm.engine.runner.backend.decoder = False  # the compiled decoder would bypass the layers
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(texts, params, use_tqdm=False)]


def report(name: str, a: list[list[int]], b: list[list[int]]) -> None:
    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    print(f"{name}: {sum(p == TOKENS for p in prefixes)} of {len(a)} identical, prefixes {prefixes}", flush=True)


def main() -> None:
    dispatch.set_int8_max_rows(1 << 30)  # integer dots on every step, as the quality gate
    texts = prompts()
    int8_batched, int8_single = greedy("gguf_int8", 16, texts), greedy("gguf_int8", 1, texts)
    reference = greedy("none", 16, texts)
    forward = CpuLinear.forward

    def fake_quantized(self, x):
        q, d = quantize_activations(x.contiguous())
        return forward(self, (q * d).reshape(x.shape))

    CpuLinear.forward = fake_quantized
    fake = greedy("none", 16, texts, fake_quant=True)
    CpuLinear.forward = forward
    report("int8 16 rows vs int8 1 row", int8_batched, int8_single)
    report("int8 vs float32", int8_batched, reference)
    report("float32 fake-quantized activations vs float32", fake, reference)
    report("int8 vs fake-quantized", int8_batched, fake)


if __name__ == "__main__":
    main()
