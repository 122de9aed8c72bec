"""The integer-dot GGUF kernels (kernels/csrc/int8_dot_cpu.cpp): every variant this CPU can
run against a torch reference of the same integer arithmetic, and against the float32
product within the error of int8 activations."""

import pytest
import torch
import torch.nn.functional as F
from test_kernels import GGUF_TYPES, gguf_packed

from kernels.cpu import extension
from kernels.cpu.dispatch import cpu_flags, int8_dot_isa
from kernels.quant import BLOCK, dequantize

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


GEMM = kernels is not None and kernels.int8_gemm_supported()
needs_gemm = pytest.mark.skipif(not GEMM, reason="no AVX512-VNNI: the repacked GEMM does not run here")


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_repacked_blocks_hold_the_same_weights(type_name):
    """repack_for_int8_gemm's values, scales and offsets rebuild the dequantized weight
    exactly (w = d u + o per block and column), so the GEMM multiplies the file's weights."""
    from kernels.quant import repack_for_int8_gemm

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


@needs_gemm
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64])
def test_int8_gemm_matches_the_integer_reference(type_name, rows):
    """The repacked GEMM on the int8 activations of int8_dot_linear (the same quantization):
    within float32 rounding of the float64 integer reference, every tile size of rows (8
    and the tails) and with or without a bias; so also within it of the row-by-row dots."""
    from kernels.quant import repack_for_int8_gemm

    packed, _ = gguf_packed(type_name, 80, 576, seed=rows)
    repacked = repack_for_int8_gemm(packed)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    bias = torch.randn(80, generator=gen)
    for b in (bias, None):
        out = kernels.int8_gemm_linear(x, *repacked, b)
        torch.testing.assert_close(out, integer_reference(x, packed, b), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(out, kernels.int8_dot_linear(x, packed, b, "avx512vnni"), atol=2e-4, rtol=1e-4)


@needs_gemm
def test_int8_gemm_zero_rows_blocks_and_bad_calls():
    from kernels.quant import repack_for_int8_gemm

    packed, _ = gguf_packed("Q4_1", 16, 64, seed=0)
    repacked = repack_for_int8_gemm(packed)
    assert kernels.int8_gemm_linear(torch.empty(0, 64), *repacked, None).shape == (0, 16)
    assert torch.equal(kernels.int8_gemm_linear(torch.zeros(2, 64), *repacked, None), torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="x has 96 features, the weight 64"):
        kernels.int8_gemm_linear(torch.randn(1, 96), *repacked, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.int8_gemm_linear(torch.randn(1, 64), *repacked, torch.randn(5))


@needs_gemm
def test_cpu_linear_in_int8_mode_runs_the_gemm_on_every_row_count():
    """quantization="gguf_int8" on an AVX512-VNNI CPU: the layer holds the repacked copy and
    serves 1 to 100 rows from it; a width that is not a multiple of 16 keeps the row dots."""
    from kernels.cpu.linear import CpuLinear, pack_linears, swap_linears
    from kernels.quant import QuantLinear

    wide, _ = gguf_packed("Q4_1", 32, 64, seed=1)
    odd, _ = gguf_packed("Q4_1", 40 - 1, 64, seed=2)
    model = torch.nn.Module()
    model.wide, model.odd = QuantLinear(wide), QuantLinear(odd)
    swap_linears(model)
    pack_linears(model, kernels, gguf_mode="int8")
    assert isinstance(model.wide, CpuLinear) and model.wide.int8_gemm is not None and model.odd.int8_gemm is None
    for rows in (1, 13, 100):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(model.wide(x), integer_reference(x, wide, None), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(model.odd(x), integer_reference(x, odd, None), atol=2e-4, rtol=1e-4)
