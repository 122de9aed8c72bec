// The CPU kernels the Python side binds (bindings.cpp); each lives in its own file.
#pragma once
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor weight,
                              c10::optional<torch::Tensor> bias);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_and_cache_(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                       torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping);
