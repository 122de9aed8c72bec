"""The CPU path choices (kernels/cpu/dispatch.py) for every ISA combination, on any machine."""

import itertools

import pytest
import torch

from kernels.cpu import dispatch

ISA_FLAGS = ["avx2", "fma", "avx_vnni", "avx512vl", "avx512_vnni", "avx512bw", "avx512_bf16", "amx_bf16"]
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
    for rows in (1, 2, dispatch.INT8_MAX_ROWS, dispatch.INT8_MAX_ROWS + 1, 512):
        path = dispatch.gguf_linear_path(flags, rows)
        assert path == (f"int8:{isa}" if isa and rows <= dispatch.INT8_MAX_ROWS else "float32")
        assert dispatch.gguf_linear_path(flags, rows, activations="float32") == "float32"
    dtype, why = dispatch.cpu_auto_dtype(flags)
    bf16_hardware = "amx_bf16" in flags or {"avx512_bf16", "avx512bw", "avx512vl"} <= flags
    assert dispatch.has_bf16_hardware(flags) == bf16_hardware
    assert dtype == torch.float32 and why  # bf16 stays opt-in until measured on AMX (dispatch.py)
    assert why.startswith("AMX-BF16 found") == ("amx_bf16" in flags and dispatch.has_bf16_hardware(flags))


def test_this_machines_flags_are_read():
    flags = dispatch.cpu_flags()
    assert isinstance(flags, frozenset)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "avx2" in flags
