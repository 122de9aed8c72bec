// Fused paged decode attention for CPU, float32: reads each sequence's K/V blocks in place
// (no gathered copy), one (sequence, kv head) pair per task on torch's thread pool.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat);
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), max_blocks = tables.size(1);
  const int64_t group = num_heads / num_kv_heads;
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* cl = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = cl[b];
      scores.assign(group * len, 0.f);
      const float* qh = q + (b * num_heads + h * group) * head_dim;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = bt[b * max_blocks + t / block_size];
        const float* kp = kc + ((h * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qp = qh + g * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qp[d] * kp[d];
          scores[g * len + t] = s * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float peak = *std::max_element(row, row + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) { row[t] = std::exp(row[t] - peak); total += row[t]; }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = bt[b * max_blocks + t / block_size];
        const float* vp = vc + ((h * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + t];
          float* ap = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ap[d] += w * vp[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        std::copy(acc.begin() + g * head_dim, acc.begin() + (g + 1) * head_dim,
                  o + (b * num_heads + h * group + g) * head_dim);
    }
  });
  return out;
}
