// y = x @ W^T + bias with W in GGUF's block formats, float32 activations and accumulation.
//
// Layout (kernels/quant.py packs it at load time): one row per output feature, each row one
// contiguous stretch, blocks of 32 input features:
//   4-bit (uint8, Q4_0 and Q4_1): [K/2 nibble bytes | K/32 float32 scales d | K/32 float32 mins m]
//       block b's 16 bytes hold element j in the low nibble and element j + 16 in the high one
//       (GGUF's own order); w = d * q + m (Q4_0: m = -8 d, exact).
//   8-bit (int8, Q8_0): [K int8 | K/32 float32 scales d]; w = d * q.
// Each weight is dequantized in registers exactly as gguf-py (and so transformers) does it:
// d * q is exact in float32 (an fp16 scale times a 4- or 8-bit integer), so fma(d, q, m)
// rounds once, like numpy's (d * q) + m. The outputs then equal the dequantized model up to
// the order of the sum.
//
// Few rows of x (decode): each group of weight rows is read once, unpacked and multiplied with
// every row of x while in registers; groups are split over torch's threads. Many rows
// (prefill): tiles of W are dequantized into a float32 buffer and multiplied by torch's mm.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_QUANT_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;

struct QProblem {
  const float* x;       // [M, K]
  const uint8_t* w;     // [N, row_bytes]
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N] with row stride ldy
  int64_t M, K, N, row_bytes, ldy;
  bool four_bit;
};

inline int64_t row_bytes_for(int64_t K, bool four_bit) {
  return four_bit ? K / 2 + (K / kBlock) * 8 : K + (K / kBlock) * 4;
}

// ---- dequantize one row into float32 (the reference order; used by the prefill path) --------
[[maybe_unused]] void dequantize_row_scalar(const uint8_t* row, int64_t K, bool four_bit, float* out) {
  const int64_t blocks = K / kBlock;
  if (four_bit) {
    const float* d = reinterpret_cast<const float*>(row + K / 2);
    const float* m = d + blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* q = row + b * 16;
      float* o = out + b * kBlock;
      for (int j = 0; j < 16; ++j) {
        o[j] = std::fma(d[b], static_cast<float>(q[j] & 0x0F), m[b]);
        o[j + 16] = std::fma(d[b], static_cast<float>(q[j] >> 4), m[b]);
      }
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    const float* d = reinterpret_cast<const float*>(row + K);
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = d[b] * static_cast<float>(q[b * kBlock + j]);
  }
}

#ifdef CONVEYOR_QUANT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of block b of a row, as 4 vectors of 8 (elements 0-7, 8-15, 16-23, 24-31).
inline void unpack_block(const uint8_t* row, int64_t K, bool four_bit, int64_t b, __m256 (&w)[4]) {
  const int64_t blocks = K / kBlock;
  if (four_bit) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const float* scales = reinterpret_cast<const float*>(row + K / 2);
    const __m256 d = _mm256_broadcast_ss(scales + b), m = _mm256_broadcast_ss(scales + blocks + b);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  } else {
    const uint8_t* q = row + b * kBlock;
    const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(row + K) + b);
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    }
  }
}

// One row into float32 with the same fma(d, q, m) (or d * q) per element as the scalar
// version: bit for bit the same floats, 8 at a time.
void dequantize_row(const uint8_t* row, int64_t K, bool four_bit, float* out) {
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    unpack_block(row, K, four_bit, b, w);
    float* o = out + b * kBlock;
    _mm256_storeu_ps(o, w[0]);
    _mm256_storeu_ps(o + 8, w[1]);
    _mm256_storeu_ps(o + 16, w[2]);
    _mm256_storeu_ps(o + 24, w[3]);
  }
}

// R weight rows from `row` times MT rows of x from `m0`.
template <int R, int MT>
inline void qdot_tile(const QProblem& p, int64_t row, int64_t m0) {
  __m256 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t blocks = p.K / kBlock;
  const float* x = p.x + m0 * p.K;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      __m256 w[4];
      unpack_block(p.w + (row + r) * p.row_bytes, p.K, p.four_bit, b, w);
      for (int m = 0; m < MT; ++m) {
        const float* xb = x + m * p.K + b * kBlock;
        __m256 a = acc[m][r];
        a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a);
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), a);
        acc[m][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), a);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      p.y[(m0 + m) * p.ldy + row + r] = hsum(acc[m][r]) + (p.bias ? p.bias[row + r] : 0.f);
}

// Rows of x in tiles of up to 2 for 4 weight rows (8 accumulators + 4 weight vectors of
// the 16 registers), of up to 4 for 2 weight rows when x has more: fewer unpacks per weight.
template <int R>
inline void qdot_rows(const QProblem& p, int64_t row) {
  int64_t m = 0;
  if (R == 4 && p.M >= 4) {
    for (int64_t half = 0; half < 4; half += 2) {
      for (m = 0; m + 4 <= p.M; m += 4) qdot_tile<2, 4>(p, row + half, m);
      switch (p.M - m) {
        case 3: qdot_tile<2, 3>(p, row + half, m); break;
        case 2: qdot_tile<2, 2>(p, row + half, m); break;
        case 1: qdot_tile<2, 1>(p, row + half, m); break;
      }
    }
    return;
  }
  for (; m + 2 <= p.M; m += 2) qdot_tile<R, 2>(p, row, m);
  if (m < p.M) qdot_tile<R, 1>(p, row, m);
}
#else
void dequantize_row(const uint8_t* row, int64_t K, bool four_bit, float* out) {
  dequantize_row_scalar(row, K, four_bit, out);
}

// Portable: dequantize the row once per group, then plain dots (the compiler vectorizes them).
template <int R>
inline void qdot_rows(const QProblem& p, int64_t row) {
  std::vector<float> w(p.K);
  for (int r = 0; r < R; ++r) {
    dequantize_row(p.w + (row + r) * p.row_bytes, p.K, p.four_bit, w.data());
    for (int64_t m = 0; m < p.M; ++m) {
      const float* x = p.x + m * p.K;
      float s = 0.f;
      for (int64_t k = 0; k < p.K; ++k) s += w[k] * x[k];
      p.y[m * p.ldy + row + r] = s + (p.bias ? p.bias[row + r] : 0.f);
    }
  }
}
#endif

void run_few_rows(const QProblem& p) {
  constexpr int R = 4;
  const int64_t groups = p.N / R;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) qdot_rows<R>(p, g * R);
  });
  for (int64_t row = groups * R; row < p.N; ++row) qdot_rows<1>(p, row);
}

void check_weight(const torch::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "quantized weight: [N, row bytes] contiguous");
  TORCH_CHECK(K % kBlock == 0, "quantized weight: in_features must be a multiple of 32");
  const bool four_bit = weight.scalar_type() == torch::kUInt8;
  TORCH_CHECK(four_bit || weight.scalar_type() == torch::kInt8, "quantized weight: uint8 (4-bit) or int8 (8-bit)");
  TORCH_CHECK(weight.size(1) == row_bytes_for(K, four_bit), "quantized weight: ", weight.size(1),
              " bytes per row do not fit in_features ", K);
}

int64_t quant_few_rows = kQuantFewRows;
int64_t quant_tile_bytes = kQuantTileBytes;
bool quant_per_thread_tiles = kQuantPerThreadTiles;

}  // namespace

void set_quant_few_rows(int64_t rows) { quant_few_rows = rows; }
void set_quant_tiling(int64_t tile_bytes, bool per_thread) {
  quant_tile_bytes = tile_bytes;
  quant_per_thread_tiles = per_thread;
}

bool is_quantized_weight(const torch::Tensor& weight) {
  return weight.scalar_type() == torch::kUInt8 || weight.scalar_type() == torch::kInt8;
}

torch::Tensor dequantize_weight(torch::Tensor weight, int64_t in_features) {
  check_weight(weight, in_features);
  const bool four_bit = weight.scalar_type() == torch::kUInt8;
  const int64_t N = weight.size(0), rb = weight.size(1);
  auto out = torch::empty({N, in_features}, torch::dtype(torch::kFloat));
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(w + n * rb, in_features, four_bit, o + n * in_features);
  });
  return out;
}

torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "quantized_linear: x [M, K] float32");
  const int64_t K = x.size(1), N = weight.size(0), M = x.size(0);
  check_weight(weight, K);
  x = x.detach().contiguous();
  auto y = torch::empty({M, N}, x.options());
  // detached: the out= matmuls below refuse tensors that require grad (a bias Parameter)
  torch::Tensor b = bias.has_value() && bias->defined() && bias->numel() ? bias->detach().contiguous() : torch::Tensor();
  if (M == 0) return y;
  const bool four_bit = weight.scalar_type() == torch::kUInt8;
  if (M <= quant_few_rows) {
    QProblem p{x.data_ptr<float>(), static_cast<const uint8_t*>(weight.data_ptr()),
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, weight.size(1), N,
               four_bit};
    run_few_rows(p);
    return y;
  }
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t rb = weight.size(1);
  // Many rows: dequantize a tile of weight rows (about quant_tile_bytes of float32, to stay
  // in L2) and let torch's mm multiply it; the tile is reused for every row of x.
  const int64_t tile = std::min(N, std::max<int64_t>(16, (quant_tile_bytes / (K * 4)) / 16 * 16));
  auto multiply = [&](const torch::Tensor& buffer, int64_t n0, int64_t rows) {
    auto out = y.narrow(1, n0, rows);
    auto wt = buffer.narrow(0, 0, rows).t();
    if (b.defined()) at::addmm_out(out, b.narrow(0, n0, rows), x, wt);
    else at::mm_out(out, x, wt);
  };
  if (quant_per_thread_tiles) {
    // Each thread dequantizes its own tiles and multiplies them single-threaded (torch's
    // parallel regions do not nest): no barrier between the dequantization and the mm.
    const int64_t threads = at::get_num_threads();
    const int64_t share = ((N + threads - 1) / threads + 15) / 16 * 16;  // every thread busy
    const int64_t own = std::min(tile, std::max<int64_t>(16, share));
    const int64_t tiles = (N + own - 1) / own;
    // torch's worker threads do not inherit the caller's inference mode, and an mm into
    // y (an inference tensor when the caller is in inference mode) must run in it too
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      c10::InferenceMode same_mode(inference);
      auto buffer = torch::empty({own, K}, x.options());
      float* o = buffer.data_ptr<float>();
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * own, rows = std::min(own, N - n0);
        for (int64_t n = 0; n < rows; ++n) dequantize_row(w + (n0 + n) * rb, K, four_bit, o + n * K);
        multiply(buffer, n0, rows);
      }
    });
    return y;
  }
  auto buffer = torch::empty({tile, K}, x.options());
  float* o = buffer.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t rows = std::min(tile, N - n0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) dequantize_row(w + (n0 + n) * rb, K, four_bit, o + n * K);
    });
    multiply(buffer, n0, rows);
  }
  return y;
}
