// d9d/kernels/rope.hpp — rotary position embedding as a LibTorch custom op (`d9d::rope`).
//
//   auto [cos, sin] = rope.half_tables(seq_len, device);   // each [T, D/2], float32
//   at::Tensor q_rotated = d9d::kernels::rope(q, cos, sin);  // q: [..., T, H, D], any float dtype
//   q_rotated.sum().backward();                              // autograd through the op
//
// The half-split ("rotate_half") layout of Hugging Face's Qwen/Llama: with x = [x1, x2] along the
// last dimension (D/2 each) and the angles of position t, y1 = x1 cos - x2 sin and
// y2 = x2 cos + x1 sin, computed in float (double for double inputs) and rounded once. The position
// of an element is its index along dim -3 (x is [batch, T, heads, D], the layout projections give
// before the head transpose). The backward is the inverse rotation (sin negated): the same kernel.
// Schemas (namespace `d9d`, src/kernels/rope.cpp):
//   rope(Tensor x, Tensor cos, Tensor sin) -> Tensor                      (autograd)
//   rope_forward(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor  (no autograd)
// Kernels: CPU (the reference, src/kernels/rope.cpp) and CUDA (kernels/rope.cu).
#pragma once

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// x rotated by the angles whose cosines and sines are `cos` and `sin` ([T, D/2], float32 or
/// float64), with autograd.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

/// The kernel alone (`inverse`: rotate by minus the angles, the backward). No autograd.
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        bool inverse);

namespace detail {

/// x's shape seen by the kernels: `rows` vectors of D (= 2 * half) elements, position
/// (row / heads) % positions.
struct RopeShape {
  int64_t rows = 0;
  int64_t positions = 0;
  int64_t heads = 0;
  int64_t half = 0;
};

/// Checks rope_forward's arguments; raises a c10::Error naming the argument otherwise.
RopeShape check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace detail
}  // namespace d9d::kernels
