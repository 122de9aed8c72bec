// The small per-token operations between a decoder layer's matmuls, fused for CPU float32:
// at decode batch sizes each torch op costs more in dispatch than in arithmetic, and a
// layer has about forty of them. Same arithmetic order as the torch reference path
// (kernels/layer_ops.py) except for the order of the sum of squares.
#include "cpu_kernels.h"
#include "vector_math.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kTokensPerTask = 4;  // short rows: one thread handles a few tokens

template <typename T>  // the output's element: float, or uint16_t for bfloat16
inline void normalize_row(const float* in, const float* weight, T* out, int64_t n, float eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += in[i] * in[i];
  const float scale = 1.f / std::sqrt(squares / n + eps);
  for (int64_t i = 0; i < n; ++i) store(out, i, weight[i] * (in[i] * scale));
}

// x1 * cos - x2 * sin | x2 * cos + x1 * sin, the halves of one head (rotate_half convention)
inline void rotate_row(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, ": float32 only");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "rms_norm: x [T, H] contiguous");
  check_rows(x, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) normalize_row(xp + t * n, wp, op + t * n, n, (float)eps);
  });
  return out;
}

namespace {

template <typename T>  // x's element: float, or uint16_t for bfloat16 (a bf16 product)
void add_and_normalize_rows(T* xp, float* rp, const float* wp, int64_t tokens, int64_t n, float eps) {
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xp + t * n;
      float* rr = rp + t * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = load(xr, i) + rr[i];
      normalize_row(rr, wp, xr, n, eps);
    }
  });
}

}  // namespace

// residual += x, then x = norm(residual) in x's dtype (float32 or bfloat16); residual and
// weight float32, so the stream itself keeps float32 precision.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: x and residual [T, H] contiguous");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous(), "add_rms_norm_: weight float32");
  const int64_t n = x.size(1);
  dispatch_float_or_bf16(x, "add_rms_norm_", [&](auto element) {
    using T = decltype(element);
    add_and_normalize_rows<T>(elements<T>(x), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), n,
                              (float)eps);
  });
}

namespace {

template <typename T>  // float, or uint16_t for bfloat16 (float32 arithmetic either way)
void silu_and_mul_rows(const T* gate_up, T* out, int64_t tokens, int64_t inter) {
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T *gate = gate_up + t * 2 * inter, *up = gate + inter;
      T* o = out + t * inter;
      for (int64_t i = 0; i < inter; ++i) store(o, i, silu(load(gate, i)) * load(up, i));
    }
  });
}

}  // namespace

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(), "silu_and_mul: gate_up [T, 2 I] contiguous");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({tokens, inter}, gate_up.options());
  dispatch_float_or_bf16(gate_up, "silu_and_mul", [&](auto element) {
    using T = decltype(element);
    silu_and_mul_rows<T>(elements<T>(gate_up), elements<T>(out), tokens, inter);
  });
  return out;
}

namespace {

template <typename T>  // the caches' element: float, or uint16_t for bfloat16
void rotate_and_store(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                      const torch::Tensor& sin, T* kc, T* vc, int64_t cache_slots, const int64_t* slot) {
  const int64_t tokens = q.size(0), q_heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *vp = v.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * dim, *s = sp + t * dim;
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(qp + t * q.stride(0) + h * q.stride(1), c, s, dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* key = kp + t * k.stride(0) + h * k.stride(1);
        const float* value = vp + t * v.stride(0) + h * v.stride(1);
        rotate_row(key, c, s, dim);
        T *key_slot = kc + (h * cache_slots + slot[t]) * dim, *value_slot = vc + (h * cache_slots + slot[t]) * dim;
        for (int64_t d = 0; d < dim; ++d) store(key_slot, d, key[d]);
        for (int64_t d = 0; d < dim; ++d) store(value_slot, d, value[d]);
      }
    }
  });
}

}  // namespace

void rotary_and_cache_(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                       torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping) {
  for (auto* t : {&q, &k, &v}) check_rows(*t, "rotary_and_cache_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_and_cache_: cos/sin [T, D] and caches contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "rotary_and_cache_: caches of one dtype");
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);  // per kv head
  const int64_t* slot = slots.data_ptr<int64_t>();
  dispatch_float_or_bf16(k_cache, "rotary_and_cache_", [&](auto element) {
    using T = decltype(element);
    rotate_and_store<T>(q, k, v, cos, sin, elements<T>(k_cache), elements<T>(v_cache), cache_slots, slot);
  });
}
