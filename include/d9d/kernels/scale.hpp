// d9d/kernels/scale.hpp — every tensor of a list multiplied in place by one scalar that lives on
// the device, as a LibTorch custom op (`d9d::scale_`): the gradient clipping's scale, computed on
// the device, applied without the host waiting for it.
//
//   const auto scale = max_norm / (norm + 1e-6);   // a 0-dim float32 tensor on the device
//   d9d::kernels::scale(grads, scale);             // in place; one launch for bfloat16 on CUDA
//
// The tensors share a device and a dtype; `scale` is a floating 0-dim (or one-element) tensor on
// that device. bfloat16 elements become round(float32(x) * float32(scale)), rounded to nearest
// even once; other dtypes get x * scale in their own dtype (at::_foreach_mul_). Schema (namespace
// `d9d`, src/kernels/scale.cpp):
//   scale_(Tensor(a!)[] tensors, Tensor scale) -> ()                             (no autograd)
// Kernels: CPU (the reference, src/kernels/scale.cpp) and CUDA (kernels/scale.cu: one launch for
// a bfloat16 list; the per-tensor definition under CUDA graph capture and for non-contiguous
// tensors).
#pragma once

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// Multiplies every tensor of `tensors` in place by the 0-dim `factor` (the op `d9d::scale_`;
/// see above).
void scale(at::TensorList tensors, const at::Tensor& factor);

namespace detail {

/// Checks the list and the scale: defined floating tensors of one dtype on the scale's device, a
/// floating one-element scale.
void check_scale(at::TensorList tensors, const at::Tensor& scale);

/// The definition for one bfloat16 tensor: the product in float32 with the float32 `factor`,
/// rounded once (nearest even) by the copy. The CPU kernel, and the CUDA kernel's per-tensor path.
void scale_by_definition(const at::Tensor& t, const at::Tensor& factor);

}  // namespace detail
}  // namespace d9d::kernels
