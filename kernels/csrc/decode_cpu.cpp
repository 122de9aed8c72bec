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
                           double scale)
    : final_norm_(std::move(final_norm)), eps_(eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), scale_(scale) {
  for (auto& t : layers) {
    TORCH_CHECK(t.size() == 12, "LlamaDecoder: 12 tensors per layer");
    layers_.push_back({t[0], t[1], t[2], bias_or_none(t[3]), t[4], bias_or_none(t[5]), t[6],
                       bias_or_none(t[7]), t[8], bias_or_none(t[9]), t[10], t[11]});
  }
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
    auto qkv = few_rows_linear(hidden, l.qkv, l.qkv_bias);
    auto q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    rotary_and_cache_(q, k, v, cos, sin, l.k_cache, l.v_cache, slot_mapping);
    auto attention = paged_decode_attention(q.contiguous(), l.k_cache, l.v_cache, block_tables, context_lens, scale_);
    auto out = few_rows_linear(attention.view({tokens, q_size}), l.o, l.o_bias);
    add_rms_norm_(out, residual, l.post_norm, eps_);
    auto gate_up = few_rows_linear(out, l.gate_up, l.gate_up_bias);
    hidden = few_rows_linear(silu_and_mul(gate_up), l.down, l.down_bias);
  }
  add_rms_norm_(hidden, residual, final_norm_, eps_);
  return hidden;
}
