// The kernels' entry points, shared by the source files and the Python module (bound in int8_linear.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

// int8_linear.cpp
torch::Tensor pad_weights(torch::Tensor w);  // int8 (N, K) -> zeros-padded (N to BLOCK outputs, K to 4 inputs)
torch::Tensor pack(torch::Tensor w);
std::vector<torch::Tensor> quantize(torch::Tensor x, torch::Tensor refine, int64_t outliers);
torch::Tensor finish(torch::Tensor acc, torch::Tensor ws, torch::Tensor xscale, torch::Tensor refine,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> packed,
                     c10::optional<torch::Tensor> outlier_idx, c10::optional<torch::Tensor> outlier_val);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                     torch::Tensor refine, int64_t outliers);
// lm_head.cpp
std::vector<torch::Tensor> head_pack(torch::Tensor w);
std::vector<torch::Tensor> head_greedy(torch::Tensor x, torch::Tensor packed, torch::Tensor mean, torch::Tensor margin,
                                       torch::Tensor weight, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                                       double z);
torch::Tensor argmax_rows(torch::Tensor logits);
// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t KVH,
                         double q_scale, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots);
torch::Tensor attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots, torch::Tensor kv_off,
                     torch::Tensor q_off);
torch::Tensor swiglu(torch::Tensor gu);
// decode_stack.cpp
void register_decode_stack(pybind11::module& m);
