"""CpuLinear, the fast float32 linear layer, and the pass that swaps a model's linears for it
and packs their weights (oneDNN blocked copies, row-interleaved copies in a huge-page arena)."""

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.cpu.dispatch import cpu_flags, gguf_blocks_max_rows, gguf_linear_path, int8_gemm_isa
from conveyor.kernels.cpu.memory import huge_page_copies
from conveyor.kernels.quant import QuantLinear, dequantize, is_packed, repack_for_int8_gemm

GGUF_MODES = ("blocks", "int8", "float32_copy", "bf16_copy")  # see CpuLinear.pack
COPY_DTYPES = {"float32_copy": torch.float32, "bf16_copy": torch.bfloat16}
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)  # what the GGUF paths take (bf16: see bf16_output)


class CpuLinear(nn.Module):
    """``x @ W^T + b`` on CPU float32, on the fastest path for the number of rows of ``x``:

    - at most ``FEW_ROWS`` (single-stream decode): the compiled kernel, which streams the
      weight once at nearly the machine's read bandwidth, from a row-interleaved copy
      (``interleave_rows``: each group of 16 rows one contiguous stretch) where the
      shapes allow it (multiples of 16);
    - more: oneDNN on a copy of the weight packed in its blocked layout (``pack()``), 1.3-2.5x
      MKL's sgemm from 4 rows up to prefill chunks; without oneDNN, MKL on the plain weight.
      With the interleaved copy the matmul weights are held three times. oneDNN compiles and caches a kernel
      per input shape (~0.5 MB each), so rows are padded up to a few bucket sizes
      (``row_bucket``): a bounded set of shapes instead of one per batch size seen.

    A GGUF-packed weight (kernels/quant.py: uint8 4-bit or int8 8-bit blocks) is held as it
    is; ``dispatch.gguf_linear_path`` picks the kernel for a step's rows. With int8
    activations (``pack(gguf_mode="int8")``, what ``quantization="gguf_int8"`` asks, and
    ``dtype="auto"`` on AVX2 CPUs without AMX) every step runs integer dots from a copy
    repacked for the GEMM (``int8_gemm``, kernels/csrc/int8_gemm_cpu.cpp: 512-bit dpbusd with
    AVX512-VNNI, else AVX2 maddubs; widths that are multiples of 16); a layer of another width
    runs steps of up to ``dispatch.INT8_MAX_ROWS`` rows on the row dots
    (kernels/csrc/int8_dot_cpu.cpp) and more on the blocks in float32, with no oneDNN copy
    (slower prefill for such a layer; SmolLM2 has none). Otherwise, and for more rows, the
    compiled ``quantized_linear`` unpacks the blocks to float32 in registers for up to
    ``kQuantFewRows`` rows of x and dequantizes a tile at a time into torch's mm for more.
    ``gguf_mode="float32_copy"`` (what ``quantization="auto"`` asks) adds a oneDNN float32
    copy for steps of more than ``blocks_max_rows`` rows (the CPU's crossover: 12 on AVX2, where
    the blocks lose 7-16% to it beyond; 4 with AVX-512, docs/performance.md), so each path
    serves the rows it is fastest for.
    ``gguf_mode="bf16_copy"`` (``quantization="gguf_bf16"``, and ``"auto"`` with
    ``dtype="auto"`` on AMX) makes that copy bfloat16: those steps cast x to bf16 and oneDNN
    runs the hardware's bf16 dot products into float32 results (1.7-2x the float32 copy
    from 16 rows up on an AVX512-BF16 EPYC); the rest of the model stays float32.

    Shares the weight it wraps (a tied head shares the embedding table). A weight it alone
    holds and every step reads from the int8 GEMM's copy is released once that copy exists
    (``owns_weight``; its shape and dtype stay, on the meta device): nothing is held twice."""

    FEW_ROWS = 2  # crossover measured on a 2-core AVX-512 machine (benchmarks/cpu_speed.py)
    PACK_BATCH_HINT = 64  # rows oneDNN tunes the blocked layout for
    # quantized_linear's many-rows tiling: per-thread tiles of 512 KiB float32 (each thread
    # dequantizes and multiplies its own; 1.3x faster than shared tiles at 16 rows, 2-core AVX2 EPYC)
    QUANT_TILE_BYTES, QUANT_PER_THREAD_TILES = 1 << 19, True
    # the compiled few-row kernel's bound over GGUF blocks without a copy (the whole-model
    # decoder's too); with a copy the crossover is the CPU's (dispatch.gguf_blocks_max_rows)
    QUANT_MAX_ROWS = 12

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, bf16_output: bool = False, owns_weight: bool = True
    ):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.owns_weight = owns_weight  # False: shared (a tied head's embedding table), never released
        # a bf16 copy's product may stay bf16 (its reader takes it: SiLU-and-mul, add_rms_norm)
        self.bf16_output = bf16_output and bias is None
        self.kernels = None  # the compiled extension, from pack()
        # (few-row weight, bias, oneDNN-packed weight or None) as plain attributes, from pack()
        self.fast_path: tuple | None = None
        self.activations = "float32"  # GGUF blocks: "int8" where pack() was asked for integer dots
        self.blocks_max_rows = self.QUANT_MAX_ROWS  # GGUF blocks with a copy: the copy serves more rows
        # int8 activations: (the blocks repacked for int8_gemm_linear, its variant)
        self.int8_gemm: tuple | None = None

    def pack(self, kernels, interleaved: torch.Tensor | None = None, gguf_mode: str = "blocks") -> None:
        """Make the oneDNN copy and take the compiled ``kernels`` (None: none) and the few-row
        kernel's ``interleaved`` copy (see ``pack_linears``); call once the weight has its
        final dtype and place. GGUF blocks (``gguf_mode``): "blocks" alone on float32
        activations; "int8", integer dots on int8 activations (every step from a copy of the
        blocks repacked for the GEMM where the width is a multiple of 16, else the row dots); "float32_copy" / "bf16_copy" with a oneDNN
        copy for steps of many rows."""
        assert gguf_mode in GGUF_MODES, gguf_mode
        if is_packed(self.weight):
            if kernels is not None:
                kernels.set_quant_tiling(self.QUANT_TILE_BYTES, self.QUANT_PER_THREAD_TILES)
                self.kernels = kernels
                copy_dtype = COPY_DTYPES.get(gguf_mode)
                packed = None
                if copy_dtype is not None:
                    dense = dequantize(self.weight.detach()).to(copy_dtype)
                    packed = onednn_packed(dense, self.PACK_BATCH_HINT)
                    self.blocks_max_rows = gguf_blocks_max_rows(cpu_flags(), gguf_mode)
                self.activations = "int8" if gguf_mode == "int8" else "float32"
                gemm_isa = int8_gemm_isa(cpu_flags())
                if gemm_isa == "amx" and gemm_isa not in kernels.int8_gemm_isas():
                    gemm_isa = "avx512vnni"  # the kernel could not have the tiles (Linux refused their state)
                if gguf_mode == "int8" and gemm_isa in kernels.int8_gemm_isas() and self.weight.shape[0] % 16 == 0:
                    self.int8_gemm = (*repack_for_int8_gemm(self.weight.detach()), gemm_isa)
                    if self.owns_weight:  # every step reads the repacked copy
                        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
                self.fast_path = (self.weight, self.bias, packed)
            return
        if self.weight.dtype != torch.float32:
            return
        self.kernels = kernels
        # nn.Module resolves parameters through __getattr__; a decode step reads them ~600 times
        few_rows_weight = self.weight if interleaved is None else interleaved
        self.fast_path = (few_rows_weight, self.bias, onednn_packed(self.weight.detach(), self.PACK_BATCH_HINT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:  # the paths below take rows
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        fast = self.fast_path is not None and x.dim() == 2
        # GGUF blocks take bf16 x too: a bf16_output product read by this layer
        if fast and self.fast_path[0].dtype is not torch.float32 and x.dtype in ACTIVATION_DTYPES:
            return self._gguf_forward(x, *self.fast_path)
        if x.dtype is torch.bfloat16 and (is_packed(self.weight) or self.weight.dtype is torch.float32):
            x = x.float()  # a bf16 product (bf16_output) read by a layer without a bf16 copy
        if not fast or x.dtype is not torch.float32:
            if is_packed(self.weight):
                return F.linear(x, dequantize(self.weight).to(x.dtype), self.bias)
            return F.linear(x, self.weight, self.bias)
        weight, bias, packed = self.fast_path
        rows = x.shape[0]
        if self.kernels is not None and rows <= self.FEW_ROWS:
            return self.kernels.few_rows_linear(x, weight, bias)
        if packed is not None:
            return onednn_linear(x, packed, bias)
        return F.linear(x, weight, bias)

    def _gguf_forward(self, x, weight, bias, packed) -> torch.Tensor:
        rows = x.shape[0]
        if packed is not None and rows > self.blocks_max_rows:
            return onednn_linear(x, packed, bias, keep_bf16=self.bf16_output)
        x = x.float()  # no-op for float32
        path = gguf_linear_path(cpu_flags(), rows, self.activations, self.int8_gemm is not None)
        if path == "int8:gemm":
            return self.kernels.int8_gemm_linear(x, *self.int8_gemm[:3], bias, self.int8_gemm[3])
        if path != "float32":
            return self.kernels.int8_dot_linear(x, weight, bias, path[len("int8:") :])
        return self.kernels.quantized_linear(x, weight, bias)


def onednn_packed(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """A float32 weight in oneDNN's blocked layout; None without oneDNN (MKL it is then)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, keep_bf16: bool = False
) -> torch.Tensor:
    """x @ packed^T + bias in float32; a bfloat16 ``packed`` multiplies x in bf16 (cast if
    float32) and returns bf16 with ``keep_bf16`` (no bias then), else float32."""
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    if packed.dtype is torch.bfloat16:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")[:rows]
        if keep_bf16:
            assert bias is None, "a bf16 product carries no bias"
            return y
        y = y.float()
        return y if bias is None else y.add_(bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


def row_bucket(rows: int) -> int:
    """Rows rounded up to a multiple of 8 (up to 64), 32 (up to 512), then 128: at most
    ~8 + 14 + budget/128 shapes, wasting under a third of a step's rows at worst (65 -> 96)
    and nothing on full 512-token prefill chunks."""
    step = 8 if rows <= 64 else 32 if rows <= 512 else 128
    return -(-rows // step) * step


def swap_linears(model: nn.Module) -> None:
    """Swap every nn.Linear for a CpuLinear sharing its parameters, in place; so too every
    module with a ``tied_weight`` (an output head reusing the embedding table, which has no
    parameters of its own). A module's ``BF16_OUTPUT_LINEARS`` names the children whose
    product its forward hands to a reader that takes bf16 (see CpuLinear.bf16_output)."""
    bf16_output = getattr(model, "BF16_OUTPUT_LINEARS", ())
    for name, child in list(model.named_children()):
        if isinstance(child, (nn.Linear, QuantLinear)):
            setattr(model, name, CpuLinear(child.weight, child.bias, bf16_output=name in bf16_output))
        elif isinstance(getattr(child, "tied_weight", None), torch.Tensor):
            setattr(model, name, CpuLinear(child.tied_weight, None, owns_weight=False))
        else:
            swap_linears(child)


def pack_linears(model: nn.Module, kernels, gguf_mode: str = "blocks") -> None:
    """Every CpuLinear's oneDNN copy (of GGUF blocks only with a ``*_copy`` ``gguf_mode``), and its
    row-interleaved copy for the few-row kernel (all in one huge-page arena) where the
    compiled ``kernels`` support it and the shape allows."""
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    can_interleave = kernels is not None and kernels.interleaved_supported()
    interleavable = [
        m
        for m in linears
        if can_interleave
        and m.weight.dtype == torch.float32
        and m.weight.shape[0] % 16 == 0
        and m.weight.shape[1] % 16 == 0
    ]
    copies = huge_page_copies([kernels.interleave_rows(m.weight.detach()) for m in interleavable])
    interleaved = {id(m): copy for m, copy in zip(interleavable, copies)}
    holders = _holders_by_storage(model)
    for module in linears:
        module.owns_weight &= holders.get(module.weight.untyped_storage().data_ptr(), 1) == 1
        module.pack(kernels, interleaved.get(id(module)), gguf_mode)
    move_int8_copies_to_huge_pages([m for m in linears if m.int8_gemm is not None])


def _holders_by_storage(model: nn.Module) -> dict[int, int]:
    """How many modules hold a tensor of each storage (a head placed on the embedding's
    blocks shares them: neither may release them)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.device.type == "cpu":
                key = tensor.untyped_storage().data_ptr()
                holders[key] = holders.get(key, 0) + 1
    return holders


def move_int8_copies_to_huge_pages(linears: list[CpuLinear], arena_bytes: int = 16 << 20) -> None:
    """The int8 GEMM's copies into huge-page arenas of about ``arena_bytes`` each (every step
    streams them; a few arenas rather than one, so the move holds at most one arena twice)."""
    group, size = [], 0
    for index, module in enumerate(linears):
        group.append(module)
        size += sum(t.numel() * t.element_size() for t in module.int8_gemm[:3])
        if size >= arena_bytes or index == len(linears) - 1:
            copies = huge_page_copies([t for m in group for t in m.int8_gemm[:3]])
            for position, m in enumerate(group):
                m.int8_gemm = (*copies[3 * position : 3 * position + 3], m.int8_gemm[3])
            group, size = [], 0
