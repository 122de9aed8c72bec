// A whole Llama-family decode step for one or two tokens, in one call from Python.
//
// At single-stream batch sizes the matmuls stream the weights at close to the memory
// bandwidth, and what is left of a step is dispatch: ~270 Python-level calls per step for
// SmolLM2's 30 layers, ~3 ms of a ~20 ms step. This is the CPU analogue of replaying a
// captured CUDA graph: the same kernels as the layer-by-layer path (so the same numbers),
// sequenced in C++. Weights and caches are bound once, when the engine builds it.
#include "cpu_kernels.h"

namespace {

c10::optional<torch::Tensor> bias_or_none(const torch::Tensor& bias) {
  return bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
}

}  // namespace

LlamaDecoder::LlamaDecoder(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm,
                           double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           double scale, std::string int8_gemm_isa)
    : int8_gemm_isa_(std::move(int8_gemm_isa)), final_norm_(std::move(final_norm)), eps_(eps),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {
  const bool gemm = !int8_gemm_isa_.empty();
  for (auto& t : layers) {
    TORCH_CHECK(t.size() == (gemm ? 20u : 12u), "LlamaDecoder: ", gemm ? 20 : 12, " tensors per layer");
    auto projection = [&](int i) {
      const int extra = 12 + (i - 2);  // qkv's scales at 12, offsets at 13, then o's, ...
      return gemm ? Projection{t[i], bias_or_none(t[i + 1]), t[extra], t[extra + 1]}
                  : Projection{t[i], bias_or_none(t[i + 1]), {}, {}};
    };
    layers_.push_back({t[0], t[1], projection(2), projection(4), projection(6), projection(8), t[10], t[11]});
  }
}

torch::Tensor LlamaDecoder::project(const Projection& p, const torch::Tensor& x) const {
  if (p.scales.defined()) return int8_gemm_linear(x, p.weight, p.scales, p.offsets, p.bias, int8_gemm_isa_);
  return few_rows_linear(x, p.weight, p.bias);
}

torch::Tensor LlamaDecoder::forward(torch::Tensor embedded, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor slot_mapping, torch::Tensor block_tables,
                                    torch::Tensor context_lens) const {
  const int64_t tokens = embedded.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  torch::Tensor residual = embedded;                 // updated in place, layer after layer
  torch::Tensor hidden = torch::zeros_like(embedded);  // residual + 0: the first norm's input
  for (const Layer& l : layers_) {
    add_rms_norm_(hidden, residual, l.input_norm, eps_);
    auto qkv = project(l.qkv, hidden);
    auto q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    rotary_and_cache_(q, k, v, cos, sin, l.k_cache, l.v_cache, slot_mapping);
    auto attention = paged_decode_attention(q.contiguous(), l.k_cache, l.v_cache, block_tables, context_lens, scale_);
    auto out = project(l.o, attention.view({tokens, q_size}));
    add_rms_norm_(out, residual, l.post_norm, eps_);
    auto gate_up = project(l.gate_up, out);
    hidden = project(l.down, silu_and_mul(gate_up));
  }
  add_rms_norm_(hidden, residual, final_norm_, eps_);
  return hidden;
}
