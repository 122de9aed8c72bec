// Paged attention for CPU, float32 arithmetic over float32 or bfloat16 caches: decode (one new
// token per sequence) and prefill (a sequence's new tokens over its cached prefix and
// themselves) are the same code. A "row" is one query head of one token, with its context
// length; every row is computed by the same non-inlined functions in the same order (scores
// block by block, softmax over the row, values block by block), whatever rows share its task.
// So a token's attention is the same numbers whether it came in a whole prompt, a chunk after
// a prefix-cache hit, a decode step, or beside any other sequence (issue 40: a cold prefill and
// a cache hit read the keys and values as stored, and attend in the same order).
//
// A task is one kv head of a set of rows (a decode sequence's query heads, or a tile of prompt
// tokens): each K and V block is widened to float32 once per task and read from L1 by all its
// rows. The softmax's exponentials are a vectorizable polynomial, not libm's expf (which this
// build's flags leave scalar); with AVX-512 a block's 16 scores come from one register sum
// (sum16) and its weighted V rows accumulate in registers.
#include "cpu_kernels.h"
#include "vector_math.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#define ROW_FUNCTION __attribute__((noinline))  // one compiled copy per function: same numbers for every caller

#if defined(__AVX512F__)
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
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The 8 sums of v[0..7]'s lanes in one register (lane t: the sum of v[t]).
inline __m256 sum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// scores[t] = scale * q . k[t] for t < keys (a whole cache block: lanes past a row's length
// are computed from whatever the block holds there and never read)
ROW_FUNCTION void block_scores(const float* q, const float* kb, int64_t keys, int64_t head_dim, float scale,
                               float* scores) {
#if defined(__AVX512F__)
  if (keys % 16 == 0 && head_dim % 16 == 0) {
    static constexpr int kLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};  // sum16's order
    for (int64_t t0 = 0; t0 < keys; t0 += 16) {
      const float* k = kb + t0 * head_dim;
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        for (int t = 0; t < 16; ++t)
          acc[kLane[t]] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + t * head_dim + d), acc[kLane[t]]);
      }
      _mm512_storeu_ps(scores + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (keys % 8 == 0 && head_dim % 8 == 0) {
    for (int64_t t0 = 0; t0 < keys; t0 += 8) {
      const float* k = kb + t0 * head_dim;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + t * head_dim + d), acc[t]);
      }
      _mm256_storeu_ps(scores + t0, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
    }
    return;
  }
#endif
  for (int64_t t = 0; t < keys; ++t) {
    const float* k = kb + t * head_dim;
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * k[d];
    scores[t] = dot * scale;
  }
}

// The largest of row[:len]: 16 running maxima (vectorized: a max reduction is not, under this
// build's flags, which keep NaN semantics), then theirs.
inline float row_max(const float* row, int64_t len) {
  float lanes[16];
  std::fill(lanes, lanes + 16, row[0]);
  int64_t t0 = 0;
  for (; t0 + 16 <= len; t0 += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = std::max(lanes[j], row[t0 + j]);
  for (int64_t t = t0; t < len; ++t) lanes[0] = std::max(lanes[0], row[t]);
  return *std::max_element(lanes, lanes + 16);
}

// row[:len] = softmax(row[:len]), in place
ROW_FUNCTION void softmax_row(float* row, int64_t len) {
  const float peak = row_max(row, len);
  float total = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    row[t] = exp_nonpositive(row[t] - peak);
    total += row[t];
  }
  const float inv = 1.f / total;
  for (int64_t t = 0; t < len; ++t) row[t] *= inv;
}

// out[:head_dim] += the sum over the block's first n rows of w[t] * v[t]: up to 128 wide, even
// and odd t in two chains (twice the FMAs in flight), added at the end of the block; up to
// 256, one chain in order of t (the registers would not hold two)
ROW_FUNCTION void block_weighted_sum(const float* w, const float* vb, int64_t n, int64_t head_dim, float* out) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0 && head_dim <= 128) {
    __m512 even[8], odd[8];
    const int64_t chunks = head_dim / 16;
    for (int64_t c = 0; c < chunks; ++c) even[c] = _mm512_loadu_ps(out + 16 * c), odd[c] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      const __m512 we = _mm512_set1_ps(w[t]), wo = _mm512_set1_ps(w[t + 1]);
      for (int64_t c = 0; c < chunks; ++c) {
        even[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(vb + t * head_dim + 16 * c), even[c]);
        odd[c] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(vb + (t + 1) * head_dim + 16 * c), odd[c]);
      }
    }
    if (t < n) {
      const __m512 we = _mm512_set1_ps(w[t]);
      for (int64_t c = 0; c < chunks; ++c) even[c] = _mm512_fmadd_ps(we, _mm512_loadu_ps(vb + t * head_dim + 16 * c), even[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(even[c], odd[c]));
    return;
  }
  if (head_dim % 16 == 0 && head_dim <= 256) {
    __m512 acc[16];
    const int64_t chunks = head_dim / 16;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_loadu_ps(out + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      for (int64_t c = 0; c < chunks; ++c)
        acc[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(vb + t * head_dim + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0 && head_dim <= 128) {
    __m256 acc[16];
    const int64_t chunks = head_dim / 8;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 wt = _mm256_set1_ps(w[t]);
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vb + t * head_dim + 8 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vb + t * head_dim;
    const float wt = w[t];
    for (int64_t d = 0; d < head_dim; ++d) out[d] += wt * v[d];
  }
}

// A block of a cold cache costs a DRAM round trip per 4 KiB page it spans, which the hardware
// prefetchers do not cross: at SmolLM2's 64 sequences the kernel read ~10 GB/s from a cache the
// weights had evicted. So each task asks for the next K block while it computes this one, and
// for the V block while it computes the scores.
template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 3);
}

// A cache block as float32: the block itself, or (bfloat16) widened into `scratch`.
inline const float* block_floats(const float* block, int64_t, float*) { return block; }
inline const float* block_floats(const uint16_t* block, int64_t elems, float* scratch) {
  for (int64_t i = 0; i < elems; ++i) scratch[i] = bf16_to_float(block[i]);
  return scratch;
}

// One kv head's cache as the rows of a task read it.
template <typename T>
struct HeadCache {
  const T* k;
  const T* v;
  const int64_t* blocks;  // the sequence's block table
  int64_t block_size, head_dim;
  const T* block(const T* cache, int64_t t0) const { return cache + blocks[t0 / block_size] * block_size * head_dim; }
};

// Per-thread buffers: scores [rows, longest in whole blocks], one widened block, accumulators [rows, head_dim].
struct Scratch {
  std::vector<float> scores, block, acc;
  void fit(int64_t rows, int64_t longest, int64_t block_elems, int64_t head_dim) {
    if (static_cast<int64_t>(scores.size()) < rows * longest) scores.resize(rows * longest);
    if (static_cast<int64_t>(block.size()) < block_elems) block.resize(block_elems);
    if (static_cast<int64_t>(acc.size()) < rows * head_dim) acc.resize(rows * head_dim);
  }
};

// Attention of `rows` query rows q[r] (row r attends to the first lens[r] cached tokens) into
// out[r]. Rows come in order of length (a tile's later tokens see more).
template <typename T>
void attend_rows(const HeadCache<T>& c, const float* const* q, float* const* out, const int64_t* lens, int64_t rows,
                 float scale, Scratch& s) {
  const int64_t longest = lens[rows - 1], bs = c.block_size, d = c.head_dim;
  const int64_t stride = (longest + bs - 1) / bs * bs;  // a row's scores, whole blocks
  s.fit(rows, stride, bs * d, d);
  for (int64_t t0 = 0; t0 < longest; t0 += bs) {
    if (t0 + bs < longest) prefetch(c.block(c.k, t0 + bs), bs * d);
    prefetch(c.block(c.v, t0), bs * d);
    const float* kb = block_floats(c.block(c.k, t0), bs * d, s.block.data());
    for (int64_t r = 0; r < rows; ++r)
      if (lens[r] > t0) block_scores(q[r], kb, bs, d, scale, s.scores.data() + r * stride + t0);
  }
  for (int64_t r = 0; r < rows; ++r) softmax_row(s.scores.data() + r * stride, lens[r]);
  std::fill(s.acc.begin(), s.acc.begin() + rows * d, 0.f);
  for (int64_t t0 = 0; t0 < longest; t0 += bs) {
    const int64_t n = std::min(bs, longest - t0);
    const float* vb = block_floats(c.block(c.v, t0), n * d, s.block.data());
    for (int64_t r = 0; r < rows; ++r)
      if (lens[r] > t0)
        block_weighted_sum(s.scores.data() + r * stride + t0, vb, std::min(bs, lens[r] - t0), d,
                           s.acc.data() + r * d);
  }
  for (int64_t r = 0; r < rows; ++r) std::copy(s.acc.begin() + r * d, s.acc.begin() + (r + 1) * d, out[r]);
}

struct Shape {
  int64_t num_heads, head_dim, num_kv_heads, num_blocks, block_size, group;
  explicit Shape(const torch::Tensor& query, const torch::Tensor& k_cache)
      : num_heads(query.size(1)), head_dim(query.size(2)), num_kv_heads(k_cache.size(0)),
        num_blocks(k_cache.size(1)), block_size(k_cache.size(2)), group(num_heads / num_kv_heads) {}
  template <typename T>
  HeadCache<T> head(const T* kc, const T* vc, int64_t h, const int64_t* blocks) const {
    const int64_t offset = h * num_blocks * block_size * head_dim;
    return {kc + offset, vc + offset, blocks, block_size, head_dim};
  }
};

// One task per (sequence, kv head): its rows are the query heads sharing that kv head.
template <typename T>
void decode_attention(const torch::Tensor& query, const T* kc, const T* vc, const Shape& shape,
                      const torch::Tensor& tables, const torch::Tensor& lens, float scale, torch::Tensor& out) {
  const int64_t batch = query.size(0), max_blocks = tables.size(1), g = shape.group;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, batch * shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    std::vector<const float*> rows_q(g);
    std::vector<float*> rows_out(g);
    std::vector<int64_t> row_lens(g);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / shape.num_kv_heads, h = task % shape.num_kv_heads;
      const int64_t first = (b * shape.num_heads + h * g) * shape.head_dim;
      for (int64_t r = 0; r < g; ++r) rows_q[r] = q + first + r * shape.head_dim, rows_out[r] = o + first + r * shape.head_dim;
      std::fill(row_lens.begin(), row_lens.end(), lens.data_ptr<int64_t>()[b]);
      const auto cache = shape.head(kc, vc, h, tables.data_ptr<int64_t>() + b * max_blocks);
      attend_rows(cache, rows_q.data(), rows_out.data(), row_lens.data(), g, scale, s);
    }
  });
}

// Tokens per prefill task: a tile's rows (tokens x query heads of a kv head) share each widened
// block; about 32 rows keep the tile's scores and queries in L2.
int64_t tile_tokens(int64_t group) { return std::max<int64_t>(1, 32 / group); }

// One task per (tile of new tokens, kv head); token i attends to prefix_len + i + 1 tokens. The
// causal triangle makes later tiles longer: tasks alternate short and long tiles, so each
// thread's contiguous range of tasks gets about the same work.
template <typename T>
void prefill_attention(const torch::Tensor& query, const T* kc, const T* vc, const Shape& shape,
                       const int64_t* blocks, int64_t prefix_len, float scale, torch::Tensor& out) {
  const int64_t n = query.size(0), g = shape.group, per_tile = tile_tokens(g);
  const int64_t tiles = (n + per_tile - 1) / per_tile;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles * shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    std::vector<const float*> rows_q;
    std::vector<float*> rows_out;
    std::vector<int64_t> row_lens;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t order = task / shape.num_kv_heads, h = task % shape.num_kv_heads;
      const int64_t tile = order % 2 == 0 ? order / 2 : tiles - 1 - order / 2;
      rows_q.clear(), rows_out.clear(), row_lens.clear();
      for (int64_t i = tile * per_tile; i < std::min(n, (tile + 1) * per_tile); ++i)
        for (int64_t r = 0; r < g; ++r) {
          const int64_t at = (i * shape.num_heads + h * g + r) * shape.head_dim;
          rows_q.push_back(q + at), rows_out.push_back(o + at), row_lens.push_back(prefix_len + i + 1);
        }
      attend_rows(shape.head(kc, vc, h, blocks), rows_q.data(), rows_out.data(), row_lens.data(),
                  static_cast<int64_t>(row_lens.size()), scale, s);
    }
  });
}

void check_inputs(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const char* kernel) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && v_cache.scalar_type() == k_cache.scalar_type(), kernel,
              ": float32 query, caches of one dtype");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), kernel,
              ": contiguous tensors");
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_inputs(query, k_cache, v_cache, "paged_decode_attention");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(query);
  const Shape shape(query, k_cache);
  dispatch_float_or_bf16(k_cache, "paged_decode_attention", [&](auto element) {
    using T = decltype(element);
    decode_attention<T>(query, elements<T>(k_cache), elements<T>(v_cache), shape, tables, lens,
                        static_cast<float>(scale), out);
  });
  return out;
}

torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t prefix_len, double scale) {
  check_inputs(query, k_cache, v_cache, "paged_prefill_attention");
  auto table = block_table.to(torch::kLong).contiguous();
  const Shape shape(query, k_cache);
  TORCH_CHECK(table.numel() * shape.block_size >= prefix_len + query.size(0),
              "paged_prefill_attention: the block table is shorter than the prefix and the new tokens");
  auto out = torch::empty_like(query);
  dispatch_float_or_bf16(k_cache, "paged_prefill_attention", [&](auto element) {
    using T = decltype(element);
    prefill_attention<T>(query, elements<T>(k_cache), elements<T>(v_cache), shape, table.data_ptr<int64_t>(),
                         prefix_len, static_cast<float>(scale), out);
  });
  return out;
}
