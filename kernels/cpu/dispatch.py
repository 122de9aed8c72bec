"""Which CPU path serves what: pure functions of the CPU's ISA flags (the names of
/proc/cpuinfo's ``flags`` line), so every choice is tested on any machine with every ISA
combination (tests/test_cpu_dispatch.py); ``cpu_flags()`` reads this machine's."""

import functools
from pathlib import Path

import torch

# torch's own capability names -> the flags they imply, for where /proc/cpuinfo is missing
_CAPABILITY_FLAGS = {"AVX2": {"avx2", "fma"}, "AVX512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
# Steps of up to this many rows run GGUF blocks by integer dots; more run them on float32
# activations (dequantized tiles into torch's mm), where the AVX2 integer dots lost (the
# int8 products cost as many instructions as float32 FMAs there, and maddubs + madd + cvt
# per block more). Measured on a 2-core AVX2 EPYC (benchmarks/gguf_layers.py):
# docs/performance.md "Integer-dot GGUF kernels".
INT8_MAX_ROWS = 12


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's ISA flags: /proc/cpuinfo's, else what torch's detected capability implies."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset(_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()))


def int8_dot_isa(flags: frozenset[str]) -> str | None:
    """The integer-dot variant to run (kernels/csrc/int8_dot_cpu.cpp), None without AVX2+FMA:
    dpbusd with AVX512-VNNI (+VL: it runs on 256-bit registers) or AVX-VNNI, else AVX2's
    maddubs + madd."""
    if "avx2" not in flags or "fma" not in flags:
        return None
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "avx512vnni"
    if "avx_vnni" in flags:
        return "avxvnni"
    return "avx2"


def has_int8_gemm(flags: frozenset[str]) -> bool:
    """What kernels/csrc/int8_gemm_cpu.cpp's 512-bit variant needs: dpbusd (AVX512-VNNI) with F, BW and VL."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags


def int8_gemm_isa(flags: frozenset[str]) -> str | None:
    """The repacked GEMM's variant (int8_gemm_cpu.cpp): "amx" with AMX-INT8 tiles beside
    AVX512-VNNI (tiles for steps of 32 rows and more, the 512-bit dots below, bit for bit the
    same sums), 512-bit dpbusd with AVX512-VNNI, else AVX2's maddubs + madd on 256-bit
    registers; None without AVX2+FMA."""
    if "avx2" not in flags or "fma" not in flags:
        return None
    if not has_int8_gemm(flags):
        return "avx2"
    return "amx" if {"amx_tile", "amx_int8"} <= flags else "avx512vnni"


@functools.cache  # called per GGUF layer per step: flags and rows repeat
def gguf_linear_path(flags: frozenset[str], rows: int, activations: str = "int8", repacked: bool = True) -> str:
    """How a linear over GGUF blocks multiplies ``rows`` rows of float32 activations:
    ``"int8:<isa>"`` (activations quantized per 32-block, integer dots) or ``"float32"``
    (blocks unpacked to float32 in registers or tiles). ``activations``: "int8" (the default
    path) or "float32" (exact up to summation order: quantization="gguf"). The repacked GEMM
    ("int8:gemm", its variant: ``int8_gemm_isa``) serves every row count: with AVX512-VNNI
    it ran SmolLM2's projections 3-8x the row-by-row dots at 1-16 rows and 1.1-1.6x the bf16
    copy's oneDNN at 16-256; with AVX2 2x the row dots at one row and 9-12x to 1.0x the
    float32 copy from 1 to 512 rows (2-core EPYCs, docs/performance.md). The row-by-row dots
    (up to INT8_MAX_ROWS rows) serve a layer without the repacked copy (``repacked=False``:
    ``CpuLinear`` makes none for a width that is not a multiple of 16)."""
    isa = int8_dot_isa(flags)
    if activations != "int8" or isa is None:
        return "float32"
    if repacked:  # int8_dot_isa's AVX2+FMA is all the GEMM needs (int8_gemm_isa)
        return "int8:gemm"
    return f"int8:{isa}" if rows <= INT8_MAX_ROWS else "float32"


def set_int8_max_rows(rows: int) -> None:
    """Run integer dots for steps of up to ``rows`` rows from now on (the quality gate scores
    whole prompts on them; benchmarks measure other crossovers)."""
    global INT8_MAX_ROWS
    INT8_MAX_ROWS = rows
    gguf_linear_path.cache_clear()


def has_bf16_hardware(flags: frozenset[str]) -> bool:
    """Native bf16 dot products: AMX-BF16 tiles or AVX512-BF16 (vdpbf16ps). Without either,
    oneDNN emulates bf16 and it is the slowest dtype (docs/performance.md)."""
    return "amx_bf16" in flags or {"avx512_bf16", "avx512bw", "avx512vl"} <= flags


def has_avx512(flags: frozenset[str]) -> bool:
    """What oneDNN's (and torch's) AVX-512 kernels need."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags


def gguf_auto_mode(flags: frozenset[str], dtype: str) -> str:
    """quantization="auto": how a GGUF model's layers run (kernels/cpu/linear.py ``CpuLinear.pack``).
    ``dtype="auto"`` on an x86 CPU with AVX2 (AMX included): "int8", the blocks repacked for
    integer dots on int8 activations at every row count (kernels/csrc/int8_gemm_cpu.cpp), the
    repacked copy alone held for each projection (its blocks released; a tied head's stay, as the
    embedding), no float copy (perplexity within 1%; docs/performance.md).
    Each row's integer dots and its scales are its own, so a request's tokens do not depend on
    the rows beside it in a step nor on the step's row count: with the prefill attention that
    reads the cache as stored (kernels/attention.py), a server's answers do not depend on what
    it served before (issue 40). On 2-core EPYCs, same run: with AVX512-VNNI 1.1x the bf16 copy
    end to end; with AVX2 only, 9-12x to 1.0x the float32 copy per layer from 1 to 512 rows. On
    a 2-core Xeon with AMX the bf16 copy ("gguf_bf16") ran 1.37x the int8 dots' throughput
    before they took AMX-INT8 tiles (1.14-1.20x faster batched since; not compared again), but
    oneDNN's bf16 rows depend on the rows beside them, so it is asked for, not the default.
    Elsewhere, or ``dtype="float32"``, "float32_copy": a float32 copy, token-exact up to
    summation order."""
    if dtype != "auto":
        return "float32_copy"
    if int8_gemm_isa(flags) is not None:
        return "int8"
    return "bf16_copy" if has_bf16_hardware(flags) else "float32_copy"


# Steps of up to this many rows run on the GGUF blocks (float32 activations, the compiled
# few-row kernel), more on the model's oneDNN copy. Crossovers from benchmarks/gguf_layers.py
# over SmolLM2's three projection shapes (docs/performance.md "Where the blocks stop"):
# AVX2 EPYC, float32 copy: 12; AVX-512 EPYC: the blocks (AVX2 code) tie the float32 copy
# (AVX-512 code) at 4 rows and run 0.45x it at 8; the bf16 copy wins from 3-4 rows.
BLOCKS_MAX_ROWS = {"avx2": 12, "avx512": 4, "bf16": 2}


def gguf_blocks_max_rows(flags: frozenset[str], copy_mode: str) -> int:
    """Rows up to which a GGUF layer with a oneDNN copy (``gguf_auto_mode``) runs its blocks."""
    if copy_mode == "bf16_copy":
        return BLOCKS_MAX_ROWS["bf16"]
    return BLOCKS_MAX_ROWS["avx512" if has_avx512(flags) else "avx2"]


def cpu_auto_dtype(flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """dtype="auto" on CPU, and why: float32 activations everywhere (norms, attention, and a
    float checkpoint's matmuls and KV cache stay token-exact); a .gguf model's layers run as
    ``gguf_auto_mode`` says, with a bfloat16 KV cache beside int8 activations or a bf16 copy
    (engine/model_runner.py ``resolve_kv_cache_dtype``)."""
    mode = gguf_auto_mode(flags, "auto")
    if mode == "int8":
        found = {"amx": "AMX-INT8", "avx512vnni": "AVX512-VNNI"}.get(int8_gemm_isa(flags), "AVX2")
        return torch.float32, (
            f"{found} found: float32 activations; a .gguf model's layers run integer dots on int8 "
            "activations at every step (quantization=gguf_bf16 for a bfloat16 copy instead, dtype=float32 "
            "for float32 throughout), and its KV cache is bfloat16"
        )
    if mode == "bf16_copy":
        found = "AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16"
        return torch.float32, (
            f"{found} found: float32 activations; a .gguf model's steps of more than "
            f"{BLOCKS_MAX_ROWS['bf16']} rows multiply on a bfloat16 copy of its weights, and its KV cache is bfloat16 "
            "(dtype=float32: float32 copy and cache)"
        )
    return torch.float32, "no AVX2 with FMA and no bf16 hardware (AVX512-BF16/AMX): float32"
