#include "cpu_kernels.h"

// The compute kernels touch no Python object: they let go of the GIL, so the replica's event
// loop keeps running while a step computes on the model thread (overlapped steps).
static const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "fused paged decode attention (CPU, fp32; fp32 or bf16 caches)", kNoGil);
  m.def("paged_prefill_attention", &paged_prefill_attention, "a sequence's new tokens over its paged cache, row by row as decode (CPU, fp32; fp32 or bf16 caches)", kNoGil);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, fp32)", kNoGil);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place (CPU, fp32)", kNoGil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows (CPU, fp32 or bf16)", kNoGil);
  m.def("rotary_and_cache_", &rotary_and_cache_, "rotate q and k in place, store k and v in the cache (CPU, fp32; fp32 or bf16 caches)", kNoGil);
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, torch::Tensor, double, int64_t, int64_t,
                          int64_t, double, std::string>())
      .def("forward", &LlamaDecoder::forward, "final-norm hidden states of a decode step (CPU, fp32)", kNoGil);
  m.def("interleaved_supported", [] {
#ifdef __AVX512F__
    return true;
#else
    return false;
#endif
  });
  m.def("interleave_rows", &interleave_rows, "weight [N, K] -> [N/16, K/16, 16, 16] for few_rows_linear", kNoGil);
  m.def("quantized_linear", &quantized_linear, "x @ W^T + bias, W in GGUF blocks (kernels/quant.py layout; CPU, fp32)", kNoGil);
  m.def("set_quant_few_rows", &set_quant_few_rows, "rows of x up to which quantized_linear unpacks in registers");
  m.def("set_quant_tiling", &set_quant_tiling, "quantized_linear's many-rows tiles: float32 bytes each, per thread or shared");
  m.def("quant_tile_bytes", [] { return kQuantTileBytes; }, "the default many-rows tile (float32 bytes)");
  m.def("quant_per_thread_tiles", [] { return kQuantPerThreadTiles; }, "the default many-rows tiling");
  m.def("dequantize_weight", &dequantize_weight, "GGUF-block weight -> float32 [N, K]", kNoGil);
  m.def("int8_dot_linear", &int8_dot_linear, "x @ W^T + bias, W in GGUF blocks, x quantized to int8 per 32-block (CPU)", kNoGil);
  m.def("int8_gemm_linear", &int8_gemm_linear, "x @ W^T + bias, W repacked from GGUF blocks for many rows, x int8 per 32-block (AVX512-VNNI or AVX2)", kNoGil);
  m.def("int8_gemm_isas", &int8_gemm_isas, "the int8_gemm_linear variants compiled in and runnable on this CPU");
  m.def("int8_dot_isas", &int8_dot_isas, "the int8_dot_linear variants compiled in and runnable on this CPU");
  m.def("quant_isa", [] {
#if defined(__AVX2__) && defined(__FMA__)
    return std::string("avx2");
#else
    return std::string("scalar");
#endif
  });
  m.def("few_rows_linear", &few_rows_linear, "x @ weight^T + bias for a few rows of x (CPU, fp32)", kNoGil);
}
