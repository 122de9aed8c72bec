"""The integer-dot GGUF kernels (kernels/csrc/int8_dot_cpu.cpp): every variant this CPU can
run against a torch reference of the same integer arithmetic, and against the float32
product within the error of int8 activations."""

import pytest
import torch
import torch.nn.functional as F
from test_kernels import GGUF_TYPES, gguf_packed

from conveyor.kernels.cpu import extension
from conveyor.kernels.cpu.dispatch import cpu_flags, int8_dot_isa
from conveyor.kernels.quant import BLOCK, dequantize

kernels = extension.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.int8_dot_isas(), reason="no AVX2 int8 kernels here")
RUNNABLE = kernels.int8_dot_isas() if kernels is not None else []


def quantize_activations(x: torch.Tensor):
    """Q8_1 per 32-block, as the kernel: dx = max|x| / 127, qx = round(x * 127 / max|x|)."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse), amax / 127


def integer_reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y from the int8 activations and the weight's integer blocks, in float64."""
    qx, dx = quantize_activations(x)
    w = dequantize(packed).double().reshape(packed.shape[0], -1, BLOCK)  # d q + m per block
    y = torch.einsum("mbk,nbk,mb->mn", qx.double(), w, dx[..., 0].double())
    return (y + (0 if bias is None else bias.double())).float()


def test_dispatch_picks_a_variant_this_cpu_runs():
    assert "avx2" in RUNNABLE
    assert int8_dot_isa(cpu_flags()) in RUNNABLE


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 33])
def test_int8_dot_matches_the_integer_reference(isa, type_name, rows):
    """Same integers, same scales: only float32 rounding of the block sums differs."""
    packed, _ = gguf_packed(type_name, 37, 160, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 160, generator=gen), torch.randn(37, generator=gen)
    out = kernels.int8_dot_linear(x, packed, bias, isa)
    torch.testing.assert_close(out, integer_reference(x, packed, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_int8_dot_is_close_to_float32_activations(type_name):
    """int8 activations lose under 1% of the product's magnitude (7-bit mantissa per block)."""
    packed, dense = gguf_packed(type_name, 64, 256, seed=3)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    exact = F.linear(x, dense)
    error = (kernels.int8_dot_linear(x, packed, None, "avx2") - exact).abs().max()
    assert error < 0.01 * exact.abs().max(), (error, exact.abs().max())


def test_int8_dot_zero_rows_blocks_and_bad_calls():
    packed, _ = gguf_packed("Q4_1", 8, 64, seed=0)
    assert kernels.int8_dot_linear(torch.empty(0, 64), packed, None, "avx2").shape == (0, 8)
    assert torch.equal(kernels.int8_dot_linear(torch.zeros(2, 64), packed, None, "avx2"), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="in_features 96"):
        kernels.int8_dot_linear(torch.randn(1, 96), packed, None, "avx2")
    with pytest.raises(RuntimeError, match="ISA"):
        kernels.int8_dot_linear(torch.randn(1, 64), packed, None, "avx10")


def fake_quant_reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 F.linear of the int8-quantized-then-dequantized activations and the
    dequantized blocks: what the kernel computes, up to float rounding."""
    qx, dx = quantize_activations(x)
    return F.linear((qx * dx).reshape(x.shape), dequantize(packed), bias)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 64])
def test_int8_dot_on_many_rows_matches_the_fake_quantized_float32(isa, type_name, rows):
    """Every row of a multi-row step against the float32 product of its own int8 activations
    (SmolLM2-sized K, N with a remainder group): a row/column stride slip, another row's
    scales or a wrong Q4_1 min term shows up as an error far above float rounding."""
    packed, _ = gguf_packed(type_name, 70, 576, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * torch.rand(rows, 1, generator=gen) * 4  # rows of different scales
    bias = torch.randn(70, generator=gen)
    for b in (bias, None):
        out = kernels.int8_dot_linear(x, packed, b, isa)
        torch.testing.assert_close(out, fake_quant_reference(x, packed, b), atol=2e-4, rtol=1e-4)


GEMM_ISAS = kernels.int8_gemm_isas() if kernels is not None else []
needs_gemm = pytest.mark.skipif(not GEMM_ISAS, reason="no AVX2: the repacked GEMM does not run here")
# every GEMM variant; the ones this CPU cannot run are skipped (compiled: test_kernels.py)
gemm_isa = pytest.mark.parametrize("isa", ["avx2", "avx512vnni", "amx"])


def skip_unless_runs(isa: str) -> None:
    if isa not in GEMM_ISAS:
        pytest.skip(f"this CPU does not run the {isa} GEMM")


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_repacked_blocks_hold_the_same_weights(type_name):
    """repack_for_int8_gemm's values, scales and offsets rebuild the dequantized weight
    exactly (w = d u + o per block and column), so the GEMM multiplies the file's weights."""
    from conveyor.kernels.quant import repack_for_int8_gemm

    packed, dense = gguf_packed(type_name, 48, 96, seed=4)
    values, scales, offsets = repack_for_int8_gemm(packed)
    groups, blocks = 3, 3
    four_bit = values.shape[2] == 256
    v = values.reshape(groups, blocks, -1, 16, 4).to(torch.int16)  # [group, block, vector, column, byte]
    if four_bit:
        v = torch.cat([v & 0x0F, v >> 4], dim=2)  # vectors 0-3: low nibbles, 4-7: high
    u = v.permute(0, 3, 1, 2, 4).reshape(48, blocks, BLOCK).float()  # [column, block, element]
    d = scales.transpose(1, 2).reshape(48, blocks, 1)
    o = offsets.transpose(1, 2).reshape(48, blocks, 1)
    assert torch.equal((d * u + o).reshape(48, 96), dense)


@gemm_isa
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 64])
def test_int8_gemm_matches_the_integer_reference(isa, type_name, rows):
    """The repacked GEMM on the int8 activations of int8_dot_linear (the same quantization):
    within float32 rounding of the float64 integer reference, every tile size of rows (8 or
    4 and the tails) and with or without a bias; so also within it of the row-by-row dots.
    x reaches +-127 in every block, the AVX2 variant's int16 sums' worst case for 4-bit."""
    from conveyor.kernels.quant import repack_for_int8_gemm

    skip_unless_runs(isa)

    packed, _ = gguf_packed(type_name, 80, 576, seed=rows)
    repacked = repack_for_int8_gemm(packed)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    bias = torch.randn(80, generator=gen)
    for b in (bias, None):
        out = kernels.int8_gemm_linear(x, *repacked, b, isa)
        torch.testing.assert_close(out, integer_reference(x, packed, b), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(out, kernels.int8_dot_linear(x, packed, b, "avx2"), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_amx_tiles_give_the_512_bit_dots_sums_bit_for_bit(type_name):
    """The AMX variant (tiles from 32 rows, x padded to whole tiles of 16) returns exactly the
    AVX512-VNNI variant's floats, so a row's result does not depend on the step's row count
    (issue 40) though steps of few rows run the dots and large ones the tiles; an odd count
    of blocks (K = 96: the tail block) and tails of rows included."""
    from conveyor.kernels.quant import repack_for_int8_gemm

    skip_unless_runs("amx")
    for features in (96, 576):
        packed, _ = gguf_packed(type_name, 48, features, seed=features)
        repacked = repack_for_int8_gemm(packed)
        gen = torch.Generator().manual_seed(features)
        x = torch.randn(100, features, generator=gen) * torch.rand(100, 1, generator=gen) * 4
        bias = torch.randn(48, generator=gen)
        for rows in (31, 32, 33, 47, 64, 100):
            tiles = kernels.int8_gemm_linear(x[:rows], *repacked, bias, "amx")
            assert torch.equal(tiles, kernels.int8_gemm_linear(x[:rows], *repacked, bias, "avx512vnni"))
            assert torch.equal(tiles[:1], kernels.int8_gemm_linear(x[:1], *repacked, bias, "amx"))


@gemm_isa
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_int8_gemm_at_the_largest_integer_sums(isa, type_name):
    """Weights at their largest stored value (4-bit u = 15, 8-bit |q| = 127) times x at +-127
    in every lane: the AVX2 variant's int16 sums of a 4-bit block reach 16 x 15 x 127 = 30,480
    (of 32,767) and its 8-bit pairs 2 x 128 x 127 (a block of q = -128); nothing wraps or
    saturates."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from conveyor.kernels.quant import pack_gguf_blocks, repack_for_int8_gemm

    skip_unless_runs(isa)
    qtype = GGMLQuantizationType[type_name]
    weight = np.ones((32, 256), np.float32)
    weight[16:] = -1.0
    weight[:, ::32] = 0.0 if type_name == "Q4_1" else weight[:, ::32]  # Q4_1: min 0, so 1.0 -> u = 15
    raw = quantize(weight, qtype)
    if type_name == "Q8_0":  # q = -128 (u = 0), which gguf's quantizer never writes but a file may hold
        raw[0, 2:34] = 0x80  # row 0, block 0: a float16 scale, then 32 int8 values
    packed = pack_gguf_blocks(raw, int(qtype))
    x = torch.cat([torch.ones(3, 256), -torch.ones(2, 256)])
    out = kernels.int8_gemm_linear(x, *repack_for_int8_gemm(packed), None, isa)
    torch.testing.assert_close(out, integer_reference(x, packed, None), atol=2e-4, rtol=1e-5)


@gemm_isa
def test_int8_gemm_zero_rows_blocks_and_bad_calls(isa):
    from conveyor.kernels.quant import repack_for_int8_gemm

    skip_unless_runs(isa)
    packed, _ = gguf_packed("Q4_1", 16, 64, seed=0)
    repacked = repack_for_int8_gemm(packed)
    assert kernels.int8_gemm_linear(torch.empty(0, 64), *repacked, None, isa).shape == (0, 16)
    assert torch.equal(kernels.int8_gemm_linear(torch.zeros(2, 64), *repacked, None, isa), torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        kernels.int8_gemm_linear(torch.randn(1, 96), *repacked, None, isa)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.int8_gemm_linear(torch.randn(1, 64), *repacked, torch.randn(5), isa)
    with pytest.raises(RuntimeError, match="isa 'sse2' does not run"):
        kernels.int8_gemm_linear(torch.randn(1, 64), *repacked, None, "sse2")


@needs_gemm
def test_cpu_linear_in_int8_mode_runs_the_gemm_on_every_row_count():
    """quantization="gguf_int8": the layer holds the repacked copy and serves 1 to 100 rows
    from it; a width that is not a multiple of 16 keeps the row dots for few rows."""
    from conveyor.kernels.cpu.dispatch import INT8_MAX_ROWS
    from conveyor.kernels.cpu.linear import CpuLinear, pack_linears, swap_linears
    from conveyor.kernels.quant import QuantLinear

    wide, _ = gguf_packed("Q4_1", 32, 64, seed=1)
    odd, odd_dense = gguf_packed("Q4_1", 40 - 1, 64, seed=2)
    model = torch.nn.Module()
    model.wide, model.odd = QuantLinear(wide), QuantLinear(odd)
    swap_linears(model)
    pack_linears(model, kernels, gguf_mode="int8")
    assert isinstance(model.wide, CpuLinear) and model.wide.int8_gemm is not None and model.odd.int8_gemm is None
    for rows in (1, 13, 100):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(model.wide(x), integer_reference(x, wide, None), atol=2e-4, rtol=1e-4)
        # the row dots up to INT8_MAX_ROWS, the blocks on float32 activations above
        odd_expected = integer_reference(x, odd, None) if rows <= INT8_MAX_ROWS else F.linear(x, odd_dense)
        torch.testing.assert_close(model.odd(x), odd_expected, atol=2e-4, rtol=1e-4)
