"""The CPU path choices (kernels/cpu/dispatch.py) for every ISA combination, on any machine."""

import itertools

import pytest
import torch

from conveyor.kernels.cpu import dispatch

ISA_FLAGS = [
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512bw",
    "avx512_bf16",
    "amx_bf16",
]
COMBINATIONS = [frozenset(c) for n in range(len(ISA_FLAGS) + 1) for c in itertools.combinations(ISA_FLAGS, n)]


def expected_isa(flags):
    if not {"avx2", "fma"} <= flags:
        return None
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "avx512vnni"
    return "avxvnni" if "avx_vnni" in flags else "avx2"


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: "+".join(sorted(f)) or "none")
def test_every_isa_combination(flags):
    isa = dispatch.int8_dot_isa(flags)
    assert isa == expected_isa(flags)
    vnni512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"} <= flags
    assert dispatch.int8_gemm_isa(flags) == ("avx512vnni" if vnni512 else "avx2" if isa else None)
    # AMX-INT8 tiles serve beside the 512-bit dots, and only there
    amx = flags | {"amx_tile", "amx_int8"}
    assert dispatch.int8_gemm_isa(amx) == ("amx" if vnni512 else "avx2" if isa else None)
    for rows in (1, 2, dispatch.INT8_MAX_ROWS, dispatch.INT8_MAX_ROWS + 1, 512):
        # the repacked GEMM serves every row count; a layer without it, the row dots few rows
        assert dispatch.gguf_linear_path(flags, rows) == ("int8:gemm" if isa else "float32")
        row_dots = dispatch.gguf_linear_path(flags, rows, repacked=False)
        assert row_dots == (f"int8:{isa}" if isa and rows <= dispatch.INT8_MAX_ROWS else "float32")
        assert dispatch.gguf_linear_path(flags, rows, activations="float32") == "float32"
    dtype, why = dispatch.cpu_auto_dtype(flags)
    bf16_hardware = "amx_bf16" in flags or {"avx512_bf16", "avx512bw", "avx512vl"} <= flags
    assert dispatch.has_bf16_hardware(flags) == bf16_hardware
    assert dtype == torch.float32 and why  # activations stay float32; what changes is the GGUF path
    # quantization="auto" with dtype="auto": int8 dots where the GEMM runs (AVX2 and up, AMX
    # included: row-invariant); else a bf16 copy on bf16 hardware; else (and dtype=float32) float32
    expected = "int8" if isa else "bf16_copy" if bf16_hardware else "float32_copy"
    assert dispatch.gguf_auto_mode(flags, "auto") == expected
    assert ("int8 activations" in why, "bfloat16 copy of its weights" in why) == (
        expected == "int8",
        expected == "bf16_copy",
    )
    assert dispatch.gguf_auto_mode(flags, "float32") == "float32_copy"
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert dispatch.gguf_blocks_max_rows(flags, "float32_copy") == (4 if avx512 else 12)
    assert dispatch.gguf_blocks_max_rows(flags, "bf16_copy") == 2


def test_this_machines_flags_are_read():
    flags = dispatch.cpu_flags()
    assert isinstance(flags, frozenset)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "avx2" in flags


@pytest.mark.parametrize("asked", ["auto", "float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("approximate_matmuls", [False, True])
def test_kv_cache_dtype_choice(asked, dtype, backend, approximate_matmuls):
    """kv_cache_dtype: auto is the model's dtype, but bfloat16 beside a bf16 copy on the CPU's
    torch backend; bfloat16 under float32 activations only there; any other mismatch is refused,
    naming the field."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.model_runner import resolve_kv_cache_dtype

    config = EngineConfig(kv_cache_dtype=asked)
    mixed_ok = backend == "torch" and dtype == torch.float32
    if asked == "auto":
        expected = torch.bfloat16 if approximate_matmuls and mixed_ok else dtype
    else:
        expected = {"float32": torch.float32, "bfloat16": torch.bfloat16}[asked]
        if expected != dtype and not (expected == torch.bfloat16 and mixed_ok):
            with pytest.raises(ValueError, match="kv_cache_dtype"):
                resolve_kv_cache_dtype(config, dtype, backend, approximate_matmuls)
            return
    assert resolve_kv_cache_dtype(config, dtype, backend, approximate_matmuls) == expected


def test_kv_cache_dtype_names_the_field_and_the_choices():
    from conveyor.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"kv_cache_dtype: must be one of \('auto', 'float32', 'bfloat16'\)"):
        EngineConfig(kv_cache_dtype="fp8")


def test_gguf_kernel_mode_per_quantization_and_cpu():
    """What each quantization asks of a GGUF layer; gguf_bf16 is refused, naming the field,
    where bf16 would be emulated."""
    from conveyor.engine.errors import ModelLoadError
    from conveyor.engine.models.loader import gguf_kernel_mode

    avx2 = frozenset({"avx2", "fma"})
    zen5 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    amx = zen5 | {"amx_bf16"}
    assert [gguf_kernel_mode("auto", "auto", f) for f in (avx2, zen5, amx)] == ["int8", "int8", "int8"]
    assert gguf_kernel_mode("auto", "auto", frozenset({"avx2"})) == "float32_copy"  # no FMA: no integer dots
    assert {gguf_kernel_mode("auto", "float32", f) for f in (avx2, zen5, amx)} == {"float32_copy"}
    assert [gguf_kernel_mode("gguf_int8", "float32", f) for f in (frozenset(), avx2)] == ["blocks", "int8"]
    assert gguf_kernel_mode("gguf_bf16", "auto", zen5) == "bf16_copy"
    with pytest.raises(ModelLoadError, match="quantization=gguf_bf16 needs a CPU with AVX512-BF16 or AMX"):
        gguf_kernel_mode("gguf_bf16", "auto", avx2)
    assert gguf_kernel_mode("gguf", "auto", zen5) == "blocks"
