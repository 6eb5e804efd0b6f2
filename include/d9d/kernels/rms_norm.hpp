// d9d/kernels/rms_norm.hpp — fused RMSNorm as a LibTorch custom op (`d9d::rms_norm`).
//
//   at::Tensor y = d9d::kernels::rms_norm(x, weight, /*eps=*/1e-6);   // x: [..., n], weight: [n]
//   y.sum().backward();                                                 // autograd through the op
//   // from anywhere: torch::Dispatcher / torch.ops.d9d.rms_norm(x, weight, 1e-6)
//
// y = x * rsqrt(mean(x², last dim) + eps) * weight, computed in float (double for double inputs)
// and rounded once to the input dtype. Schemas (namespace `d9d`, in src/kernels/rms_norm.cpp):
//   rms_norm(Tensor input, Tensor weight, float eps=1e-6) -> Tensor              (autograd)
//   rms_norm_forward(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)   (output, rstd)
//   rms_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor rstd)
//       -> (Tensor, Tensor)                                                       (grad_input,
//       grad_weight)
// Kernels: CPU (src/kernels/rms_norm.cpp, the reference) and CUDA (kernels/rms_norm.cu).
// rstd has the input's shape without its last dim, in float (double for double inputs).
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// RMSNorm over the last dimension, with autograd. `weight` must have the input's dtype.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps = 1e-6);

/// The forward kernel alone: (output, rstd). No autograd.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input,
                                                    const at::Tensor& weight, double eps);

/// The backward kernel alone: (grad_input, grad_weight). No autograd.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output,
                                                     const at::Tensor& input,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd);

}  // namespace d9d::kernels
