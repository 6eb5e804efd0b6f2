// d9d/kernels/rms_norm.hpp — fused RMSNorm as a LibTorch custom op (`d9d::rms_norm`).
//
//   at::Tensor y = d9d::kernels::rms_norm(x, weight, /*eps=*/1e-6);   // x: [..., n], weight: [n]
//   y.sum().backward();                                                 // autograd through the op
//   // from anywhere: torch::Dispatcher / torch.ops.d9d.rms_norm(x, weight, 1e-6)
//
// y = x * rsqrt(mean(x², last dim) + eps) * weight, computed in float (double for double inputs)
// and rounded once to the output dtype. Schemas (namespace `d9d`, in src/kernels/rms_norm.cpp):
//   rms_norm(Tensor input, Tensor weight, float eps=1e-6, ScalarType? out_dtype=None) -> Tensor
//                                                                                   (autograd)
//   rms_norm_forward(Tensor input, Tensor weight, float eps, ScalarType? out_dtype=None)
//       -> (Tensor, Tensor)                                                       (output, rstd)
//   rms_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor rstd)
//       -> (Tensor, Tensor)                                 (grad_input, grad_weight)
// Dtypes (input, weight, output): all the same; a bfloat16 or half input and output with a float32
// weight (mixed precision's float32 parameter used as it is: no cast of the weight, and its
// gradient comes back in float32); a float32 input and weight with a bfloat16 or half output
// (under autocast, the norm writes the dtype the next matmuls read). grad_output has the output's
// dtype, grad_input the input's and grad_weight the weight's.
// Kernels: CPU (src/kernels/rms_norm.cpp, the reference) and CUDA (kernels/rms_norm.cu).
// rstd has the input's shape without its last dim, in float (double for double inputs).
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// RMSNorm over the last dimension, with autograd, its output in `out_dtype` (default: the
/// input's). `weight` has the input's dtype, or float32 (see the combinations above).
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps = 1e-6,
                    std::optional<at::ScalarType> out_dtype = std::nullopt);

/// The forward kernel alone: (output, rstd). No autograd.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(
    const at::Tensor& input, const at::Tensor& weight, double eps,
    std::optional<at::ScalarType> out_dtype = std::nullopt);

/// The backward kernel alone: (grad_input, grad_weight). No autograd.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output,
                                                     const at::Tensor& input,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd);

}  // namespace d9d::kernels
