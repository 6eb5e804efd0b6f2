// d9d/kernels/silu_mul.hpp — SwiGLU's activation, silu(gate) * up, as a LibTorch custom op
// (`d9d::silu_mul`).
//
//   at::Tensor h = d9d::kernels::silu_mul(gate_proj(x), up_proj(x));   // same shape and dtype
//   down_proj(h).sum().backward();                                     // autograd through the op
//
// One pass forward (h = g sigmoid(g) u) and one backward (dg = dh u sigmoid(g) (1 + g (1 -
// sigmoid(g))), du = dh g sigmoid(g)), in float (double for double inputs), rounded once: what
// at::silu(gate) * up computes in three kernels forward and five backward. Schemas (namespace
// `d9d`, src/kernels/silu_mul.cpp):
//   silu_mul(Tensor gate, Tensor up) -> Tensor                                   (autograd)
//   silu_mul_forward(Tensor gate, Tensor up) -> Tensor                           (no autograd)
//   silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)   (dgate, dup)
// Kernels: CPU (the reference, src/kernels/silu_mul.cpp) and CUDA (kernels/silu_mul.cu).
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// silu(gate) * up with autograd; gate and up have the same shape, dtype and device.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

/// The forward kernel alone. No autograd.
at::Tensor silu_mul_forward(const at::Tensor& gate, const at::Tensor& up);

/// The backward kernel alone: (grad_gate, grad_up). No autograd.
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up);

namespace detail {

/// Checks that gate, up (and grad, when defined) share shape, dtype and device, floating point.
void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad);

}  // namespace detail
}  // namespace d9d::kernels
