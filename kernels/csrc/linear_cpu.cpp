// y = x @ weight^T + bias for the few rows of x a decode step has (float32, weight [N, K]).
// Such a product is bound by reading the weights: each group of weight rows is loaded once
// and multiplied with every row of x while it sits in registers and L1, and the row groups
// are split over torch's threads. MKL's sgemm reads weights at roughly half this speed
// when x has under ~16 rows.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <cassert>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // [N, K]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, K, N;
};

#ifdef __AVX512F__
// R weight rows starting at `row` times MT rows of x starting at `m0`.
template <int R, int MT>
inline void dot_step(const float* w, const float* x, int64_t K, int64_t k, __mmask16 mask, __m512 (&acc)[MT][R]) {
  for (int m = 0; m < MT; ++m) {
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < R; ++r)
      acc[m][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + r * K + k), xv, acc[m][r]);
  }
}

// R weight rows starting at `row` times MT rows of x starting at `m0`.
template <int R, int MT>
inline void dot_tile(const Problem& p, int64_t row, int64_t m0) {
  __m512 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const float* w = p.w + row * p.K;
  const float* x = p.x + m0 * p.K;
  const int64_t K = p.K, full = K / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) dot_step<R, MT>(w, x, K, k, (__mmask16)0xFFFF, acc);
  if (full < K) dot_step<R, MT>(w, x, K, full, (__mmask16)((1u << (K - full)) - 1), acc);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      p.y[(m0 + m) * p.N + row + r] = _mm512_reduce_add_ps(acc[m][r]) + (p.bias ? p.bias[row + r] : 0.f);
}

// All rows of x for R weight rows: x in tiles of up to 4 rows (R * 4 accumulators fit the
// 32 vector registers for R <= 4; R = 8 and 16 only serve 2 rows and 1 row of x).
template <int R>
inline void dot_rows(const Problem& p, int64_t row) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) dot_tile<R, 4>(p, row, m);
  switch (p.M - m) {
    case 3: dot_tile<R, 3>(p, row, m); break;
    case 2: dot_tile<R, 2>(p, row, m); break;
    case 1: dot_tile<R, 1>(p, row, m); break;
  }
}

template <>
inline void dot_rows<8>(const Problem& p, int64_t row) {
  assert(p.M == 2);
  dot_tile<8, 2>(p, row, 0);
}

template <>
inline void dot_rows<16>(const Problem& p, int64_t row) {
  assert(p.M == 1);
  dot_tile<16, 1>(p, row, 0);
}
#else
template <int R>
inline void dot_rows(const Problem& p, int64_t row) {  // portable: the compiler vectorizes the dot
  for (int64_t m = 0; m < p.M; ++m)
    for (int r = 0; r < R; ++r) {
      const float* w = p.w + (row + r) * p.K;
      const float* x = p.x + m * p.K;
      float s = 0.f;
      for (int64_t k = 0; k < p.K; ++k) s += w[k] * x[k];
      p.y[m * p.N + row + r] = s + (p.bias ? p.bias[row + r] : 0.f);
    }
}
#endif

template <int R>
void run(const Problem& p) {
  const int64_t groups = p.N / R;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) dot_rows<R>(p, g * R);
  });
  for (int64_t row = groups * R; row < p.N; ++row) dot_rows<1>(p, row);  // leftover rows
}

#ifdef __AVX512F__
// Row-interleaved weight [N/16, K/16, 16 rows, 16 columns]: a group of 16 weight rows is one
// contiguous stretch read front to back, which the hardware prefetchers follow at nearly
// the speed of a plain sum (~44 vs ~31 GB/s for 16 separate row streams in this VM's
// fast-bandwidth minutes). Same per-row summation order as the plain layout.
template <int MT>
void interleaved_group(const Problem& p, int64_t group) {
  __m512 acc[MT][16];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 16; ++r) acc[m][r] = _mm512_setzero_ps();
  const float* block = p.w + group * 16 * p.K;
  for (int64_t k = 0; k < p.K; k += 16, block += 256) {
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_loadu_ps(p.x + m * p.K + k);
      for (int r = 0; r < 16; ++r) acc[m][r] = _mm512_fmadd_ps(_mm512_load_ps(block + r * 16), xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 16; ++r) {
      const int64_t row = group * 16 + r;
      p.y[m * p.N + row] = _mm512_reduce_add_ps(acc[m][r]) + (p.bias ? p.bias[row] : 0.f);
    }
}

void run_interleaved(const Problem& p) {
  at::parallel_for(0, p.N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (p.M == 1) interleaved_group<1>(p, g);
      else interleaved_group<2>(p, g);
    }
  });
}
#endif

}  // namespace

torch::Tensor interleave_rows(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0,
              "interleave_rows: weight [N, K] with N and K multiples of 16");
  return weight.view({weight.size(0) / 16, 16, weight.size(1) / 16, 16}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  if (weight.dim() == 4) return interleaved_linear(x, weight, bias);
  if (is_quantized_weight(weight)) return quantized_linear(x, weight, bias);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), weight.size(0)}, x.options());
  torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  Problem p{x.data_ptr<float>(), weight.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
            y.data_ptr<float>(), x.size(0), x.size(1), weight.size(0)};
  if (p.M == 0) return y;
  // More weight rows in flight read faster (16 rows: ~40 GB/s where 8 get ~35 and 4 ~29
  // on a 2-core Zen 4 VM) as long as their accumulators fit the registers.
  if (p.M == 1) run<16>(p);
  else if (p.M == 2) run<8>(p);
  else run<4>(p);
  return y;
}

torch::Tensor interleaved_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == 16 && weight.is_contiguous(),
              "weight: interleave_rows() layout [N/16, K/16, 16, 16]");
  const int64_t N = weight.size(0) * 16, K = weight.size(1) * 16;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.size(0) <= 2, "x [M <= 2, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr<float>()) % 64 == 0, "weight must be 64-byte aligned");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  Problem p{x.data_ptr<float>(), weight.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
            y.data_ptr<float>(), x.size(0), K, N};
  if (p.M == 0) return y;
#ifdef __AVX512F__
  run_interleaved(p);
#else
  TORCH_CHECK(false, "interleaved_linear needs AVX-512; use the plain layout");
#endif
  return y;
}
