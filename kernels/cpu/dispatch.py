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


@functools.cache  # called per GGUF layer per step: flags and rows repeat
def gguf_linear_path(flags: frozenset[str], rows: int, activations: str = "int8") -> str:
    """How a linear over GGUF blocks multiplies ``rows`` rows of float32 activations:
    ``"int8:<isa>"`` (activations quantized per 32-block, integer dots) or ``"float32"``
    (blocks unpacked to float32 in registers or tiles). ``activations``: "int8" (the default
    path: where the ISA has integer dots, for steps of up to INT8_MAX_ROWS rows) or "float32" (exact up to
    summation order: quantization="gguf")."""
    isa = int8_dot_isa(flags)
    if activations == "int8" and isa is not None and rows <= INT8_MAX_ROWS:
        return f"int8:{isa}"
    return "float32"


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


def cpu_auto_dtype(flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """dtype="auto" on CPU, and why: float32 everywhere for now (it also keeps a .gguf model's
    blocks and is token-exact). Measured on a 2-vCPU Xeon with AVX512-BF16 but no AMX, our bf16
    ran 0.6x float32 over GGUF blocks (77 vs 113-121 tok/s); on AMX vLLM's bf16 ran ~2x its
    float32, but ours has not been measured there, so AMX only names the choice in the log."""
    if "amx_bf16" in flags and has_bf16_hardware(flags):  # our bf16 path is not yet measured there
        return torch.float32, "AMX-BF16 found: float32 until our bfloat16 is measured on AMX (dtype=bfloat16 asks)"
    if has_bf16_hardware(flags):
        return torch.float32, "AVX512-BF16 without AMX: float32 (bf16 measured slower there)"
    return torch.float32, "no bf16 hardware (AVX512-BF16/AMX): float32"
