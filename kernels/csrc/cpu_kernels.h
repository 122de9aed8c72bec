// The CPU kernels the Python side binds (bindings.cpp); each lives in its own file.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <string>
#include <vector>
#include <type_traits>

// Runs body(T{}) with T = float for a float32 tensor, uint16_t for a bfloat16 one (the element
// type of vector_math.h's load/store), and refuses any other dtype naming the kernel.
template <typename Body>
void dispatch_float_or_bf16(const torch::Tensor& t, const char* kernel, Body&& body) {
  if (t.scalar_type() == torch::kFloat) return body(float{});
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, kernel, ": float32 or bfloat16 only");
  body(uint16_t{});
}

// A float32 or bfloat16 tensor's elements as float* or uint16_t* (dispatch_float_or_bf16's T)
template <typename T>
T* elements(const torch::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);
// Causal attention of one sequence's new tokens [n, H, D] (already in the cache) over its
// first prefix_len + i + 1 cached tokens each: row by row the same numbers as a decode step.
torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t prefix_len, double scale);

// x @ weight^T + bias for a few rows of x; weight [N, K], or interleave_rows(weight) for
// at most 2 rows of x.
torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight,
                              c10::optional<torch::Tensor> bias);
torch::Tensor interleaved_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor interleave_rows(torch::Tensor weight);

// GGUF-block weights (quant_linear_cpu.cpp): uint8 [N, K/2 + K/32 * 8] (Q4_0/Q4_1: nibbles,
// scales, mins) or int8 [N, K + K/32 * 4] (Q8_0: values, scales). few_rows_linear takes them
// too. Up to kQuantFewRows rows of x run the register-unpacking kernel, more a dequantized
// tile at a time through torch's mm.
// (The default; set_quant_few_rows changes it, for measuring the crossover.)
constexpr int64_t kQuantFewRows = 8;
// Many rows: tiles of about kQuantTileBytes of dequantized float32, per thread (each thread
// dequantizes and multiplies its own tiles) or shared (all threads dequantize a tile, then
// torch's mm multiplies it with all of them). set_quant_tiling changes both, for measuring.
constexpr int64_t kQuantTileBytes = 1 << 20;
constexpr bool kQuantPerThreadTiles = false;
void set_quant_few_rows(int64_t rows);
void set_quant_tiling(int64_t tile_bytes, bool per_thread);
bool is_quantized_weight(const torch::Tensor& weight);
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor dequantize_weight(torch::Tensor weight, int64_t in_features);
// The same weights by integer dot products with x quantized per 32-block to int8
// (int8_dot_cpu.cpp); `isa` one of int8_dot_isas(): the variants compiled in and on this CPU.
std::vector<std::string> int8_dot_isas();
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                              const std::string& isa);

// x [M, K] quantized per 32-block for the integer dots (int8_dot_cpu.cpp): values, scales
// dx = max|x| / 127 and sums dx * sum(qx) per block, row by row. Both int8 kernels take it.
struct QuantizedRows {
  std::vector<int8_t> values;  // [M, K]
  std::vector<float> scales;   // [M, K / 32]
  std::vector<float> sums;     // [M, K / 32]
};
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K);

// The same weights repacked for many rows of x (int8_gemm_cpu.cpp; kernels/quant.py
// repack_for_int8_gemm): 16 output columns per 512-bit dot with AVX512-VNNI ("avx512vnni"),
// 8 per 256-bit maddubs + madd with AVX2 ("avx2"); "amx" runs AMX-INT8 tiles for steps of 32
// rows and more and the 512-bit dots below, the same floats either way.
std::vector<std::string> int8_gemm_isas();
torch::Tensor int8_gemm_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                               c10::optional<torch::Tensor> bias, const std::string& isa);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_and_cache_(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                       torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping);

// Llama-family decode of at most a few tokens through every layer (decode_cpu.cpp).
class LlamaDecoder {
 public:
  // Per layer: input norm, post-attention norm, qkv weight, qkv bias, o weight, o bias,
  // gate_up weight, gate_up bias, down weight, down bias, k cache, v cache; an empty
  // tensor for an absent bias. With `int8_gemm_isa` (int8 activations, int8_gemm_linear's
  // variant), each weight is the GEMM's repacked values and 8 more tensors follow: the
  // scales and offsets of qkv, o, gate_up and down.
  LlamaDecoder(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm, double eps,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
               std::string int8_gemm_isa);
  // The final-norm hidden states [T, H]; `embedded` [T, H] is overwritten.
  torch::Tensor forward(torch::Tensor embedded, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor context_lens) const;

 private:
  struct Projection {
    torch::Tensor weight;  // float32 (plain or interleaved), GGUF blocks, or the GEMM's values
    c10::optional<torch::Tensor> bias;
    torch::Tensor scales, offsets;  // the GEMM's; undefined: few_rows_linear serves
  };
  struct Layer {
    torch::Tensor input_norm, post_norm;
    Projection qkv, o, gate_up, down;
    torch::Tensor k_cache, v_cache;
  };
  torch::Tensor project(const Projection& p, const torch::Tensor& x) const;
  std::vector<Layer> layers_;
  std::string int8_gemm_isa_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};
