// y = x @ W^T + bias with W in GGUF blocks (kernels/quant.py layout) by integer dot products,
// as llama.cpp's CPU path: each row of x is quantized per 32-block to int8 (Q8_1-style: a
// float32 scale dx and the block's sum dx * sum(qx)), and each block pair is one integer dot:
//   4-bit: w = dw * q + mw  ->  sum w x ~= dw dx sum(q qx) + mw (dx sum qx)
//   8-bit: w = dw * q       ->  sum w x ~= dw dx sum(q qx)
// q qx is 32 u8 x s8 products: AVX2 maddubs + madd, or one dpbusd with AVX-VNNI / AVX512-VNNI.
// Each ISA's tile is compiled from int8_dot_kernel.inc under its own target attribute, so one
// binary holds all three; the caller names the one to run (kernels/cpu/dispatch.py chooses).
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_INT8_DOT 1
#endif

namespace {

struct Int8Problem {
  const int8_t* xq;   // [M, K] quantized activations
  const float* xd;    // [M, K/32] their scales
  const float* xs;    // [M, K/32] dx * sum(qx) per block
  const uint8_t* w;   // [N, row_bytes]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, K, N, row_bytes;
  bool four_bit;
};

// sum over blocks of the weight's min times the activation block's sum
inline float min_term(const float* mw, const float* xs, int64_t blocks) {
  float s = 0.f;
  for (int64_t b = 0; b < blocks; ++b) s += mw[b] * xs[b];
  return s;
}

// One row of x, block by block: dx = max|x| / 127, qx = round(x / dx).
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inverse));
      q[b * 32 + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CONVEYOR_QUANTIZE_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace {
// quantize_row's arithmetic 32 values at a time (the same int8, scales and sums: the
// multiply is the same, and cvtps_epi32 rounds half to even, as nearbyint)
void quantize_row_avx512(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
    // abs_ps is AVX512F (and_ps would need DQ, which the target does not promise)
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qhi));
    d[b] = amax / 127.f;
    s[b] = d[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}
}  // namespace
#pragma GCC pop_options
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  QuantizedRows rows{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks)};
  auto* row_quantizer = &quantize_row;
#ifdef CONVEYOR_QUANTIZE_AVX512
  if (__builtin_cpu_supports("avx512f")) row_quantizer = &quantize_row_avx512;
#endif
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      row_quantizer(x + m * K, K, rows.values.data() + m * K, rows.scales.data() + m * blocks,
                    rows.sums.data() + m * blocks);
  });
  return rows;
}

#ifdef CONVEYOR_INT8_DOT
namespace {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
}  // namespace
#define INT8_DOT_NS int8_avx2
#include "int8_dot_kernel.inc"
#undef INT8_DOT_NS

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace int8_avxvnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
}  // namespace int8_avxvnni
#define INT8_DOT_NS int8_avxvnni
#include "int8_dot_kernel.inc"
#undef INT8_DOT_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
namespace int8_avx512vnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
}  // namespace int8_avx512vnni
#define INT8_DOT_NS int8_avx512vnni
#include "int8_dot_kernel.inc"
#undef INT8_DOT_NS
#pragma GCC pop_options
#endif

std::vector<std::string> int8_dot_isas() {
  std::vector<std::string> isas;
#ifdef CONVEYOR_INT8_DOT
  isas.push_back("avx2");
  if (__builtin_cpu_supports("avxvnni")) isas.push_back("avxvnni");
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) isas.push_back("avx512vnni");
#endif
  return isas;
}

torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                              const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "int8_dot_linear: x [M, K] float32");
  TORCH_CHECK(is_quantized_weight(weight), "int8_dot_linear: a GGUF-block weight (uint8 or int8)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), blocks = K / 32;
  const bool four_bit = weight.scalar_type() == torch::kUInt8;
  TORCH_CHECK(K % 32 == 0 && weight.is_contiguous() &&
                  weight.size(1) == (four_bit ? K / 2 + blocks * 8 : K + blocks * 4),
              "int8_dot_linear: weight rows do not fit in_features ", K);
  const auto runnable = int8_dot_isas();
  TORCH_CHECK(std::find(runnable.begin(), runnable.end(), isa) != runnable.end(), "int8_dot_linear: ISA ", isa,
              " is not compiled in or not on this CPU");
  x = x.detach().contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b = bias.has_value() && bias->defined() && bias->numel() ? bias->detach().contiguous() : torch::Tensor();
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
#ifdef CONVEYOR_INT8_DOT
  const Int8Problem p{xq.values.data(), xq.scales.data(), xq.sums.data(), static_cast<const uint8_t*>(weight.data_ptr()),
                      b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, weight.size(1),
                      four_bit};
  if (isa == "avx512vnni") int8_avx512vnni::run(p);
  else if (isa == "avxvnni") int8_avxvnni::run(p);
  else int8_avx2::run(p);
#endif
  return y;
}
