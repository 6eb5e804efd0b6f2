// d9d/kernels/detail/rms_norm.hpp — argument checks shared by the CPU and CUDA RMSNorm kernels.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace d9d::kernels::detail {

/// The input seen as a [rows, cols] matrix (cols = the normalised last dimension).
struct RowShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

/// Checks rms_norm_forward's arguments (same device and dtype, weight [n] with n = input.size(-1),
/// a floating dtype); raises a c10::Error naming the argument otherwise.
RowShape check_rms_norm_forward(const at::Tensor& input, const at::Tensor& weight);

/// Checks rms_norm_backward's arguments against each other (shapes, dtypes, devices).
RowShape check_rms_norm_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                 const at::Tensor& weight, const at::Tensor& rstd);

/// The dtype of rstd and of all accumulation: double for double inputs, float otherwise.
at::ScalarType accumulate_dtype(at::ScalarType input);

}  // namespace d9d::kernels::detail
