// Fused paged decode attention for CPU, float32: reads each sequence's K/V blocks in place
// (no gathered copy), block by block, one (sequence, kv head) pair per task on torch's thread
// pool; the query heads sharing a kv head are served together. The softmax's exponentials are
// a vectorizable polynomial, not libm's expf (which this build's flags leave scalar); with
// AVX-512 a full block's 16 scores come from one register sum (sum16) and its weighted V rows
// accumulate in registers. 1.6-2x the per-token loops at 20-600 tokens of context (64
// sequences, SmolLM2's heads, 2-core AVX-512 EPYC).
#include "cpu_kernels.h"
#include "vector_math.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32: widen, shift into the upper half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The 16 sums of v[0..15]'s lanes in one register (lane t: the sum of v[t]): 4 shuffle-add
// stages and a permute instead of 16 horizontal reductions.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[i], x[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[i], y[i + 2]), _mm512_unpackhi_ps(y[i], y[i + 2]));
  const __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
  return w;
}

// scores[t] = scale * q . k[t] for the 16 rows of a K block (head_dim a multiple of 16)
template <typename T>
inline void block_scores16(const float* q, const T* kb, int64_t head_dim, float scale, float* scores) {
  static constexpr int kLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};  // sum16's order
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int t = 0; t < 16; ++t)
      acc[kLane[t]] = _mm512_fmadd_ps(qd, load16(kb + t * head_dim + d), acc[kLane[t]]);
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// out[:head_dim] += sum over the block's n rows of w[t] * v[t] (head_dim a multiple of 16, <= 256)
template <typename T>
inline void block_weighted_sum(const float* w, const T* vb, int64_t n, int64_t head_dim, float* out) {
  __m512 acc[16];
  const int64_t chunks = head_dim / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_loadu_ps(out + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(wt, load16(vb + t * head_dim + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#endif

// A block of a cold cache costs a DRAM round trip per 4 KiB page it spans, which the hardware
// prefetchers do not cross: at SmolLM2's 64 sequences the kernel read ~10 GB/s from a cache the
// weights had evicted. So each task asks for what it reads next while it computes: the next K
// block and this V block in the K pass, the next task's K blocks in the V pass.
constexpr int64_t kPrefetchBlocks = 1;  // how far ahead the K pass asks (2-4 measured no better)
template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 3);
}

// T: the caches' element, float or uint16_t (bfloat16); float32 arithmetic either way
template <typename T>
void decode_attention(const torch::Tensor& query, const T* kc, const T* vc, const torch::Tensor& k_cache,
                      const torch::Tensor& tables, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), max_blocks = tables.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const float* q = query.data_ptr<float>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* cl = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t block_elems = block_size * head_dim;

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = cl[b];
      if (static_cast<int64_t>(scores.size()) < group * len) scores.resize(group * len);
      const float* qh = q + (b * num_heads + h * group) * head_dim;
      const int64_t* row_blocks = bt + b * max_blocks;
      const auto block_of = [&](const T* cache, int64_t t0) {
        return cache + (h * num_blocks + row_blocks[t0 / block_size]) * block_elems;
      };
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* kb = block_of(kc, t0);
        const int64_t n = std::min(block_size, len - t0);
        const int64_t ahead = t0 + kPrefetchBlocks * block_size;
        if (ahead < len) prefetch(block_of(kc, ahead), std::min(block_size, len - ahead) * head_dim);
        prefetch(block_of(vc, t0), n * head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qp = qh + g * head_dim;
          float* s = scores.data() + g * len + t0;
#if defined(__AVX512F__)
          if (n == 16 && head_dim % 16 == 0) {
            block_scores16(qp, kb, head_dim, fscale, s);
            continue;
          }
#endif
          for (int64_t t = 0; t < n; ++t) {
            const T* kp = kb + t * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qp[d] * load(kp, d);
            s[t] = dot * fscale;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        float peak = row[0];
        for (int64_t t = 1; t < len; ++t) peak = std::max(peak, row[t]);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) { row[t] = exp_nonpositive(row[t] - peak); total += row[t]; }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t next_b = (task + 1) / num_kv_heads, next_h = (task + 1) % num_kv_heads;
      const int64_t next_len = task + 1 < end ? cl[next_b] : 0;
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* vb = block_of(vc, t0);
        const int64_t n = std::min(block_size, len - t0);
        if (t0 < next_len)  // the next task's K block of the same index
          prefetch(kc + (next_h * num_blocks + bt[next_b * max_blocks + t0 / block_size]) * block_elems,
                   std::min(block_size, next_len - t0) * head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* w = scores.data() + g * len + t0;
          float* __restrict ap = acc.data() + g * head_dim;
#if defined(__AVX512F__)
          if (head_dim % 16 == 0 && head_dim <= 256) {
            block_weighted_sum(w, vb, n, head_dim, ap);
            continue;
          }
#endif
          for (int64_t t = 0; t < n; ++t) {
            const T* vp = vb + t * head_dim;
            const float wt = w[t];
            for (int64_t d = 0; d < head_dim; ++d) ap[d] += wt * load(vp, d);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        std::copy(acc.begin() + g * head_dim, acc.begin() + (g + 1) * head_dim,
                  o + (b * num_heads + h * group + g) * head_dim);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: float32 query, caches of one dtype");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(query);
  dispatch_float_or_bf16(k_cache, "paged_decode_attention", [&](auto element) {
    using T = decltype(element);
    decode_attention<T>(query, elements<T>(k_cache), elements<T>(v_cache), k_cache, tables, lens, scale, out);
  });
  return out;
}
