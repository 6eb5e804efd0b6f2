// d9d/kernels/detail/rms_norm.hpp — argument checks and the dtype dispatch shared by the CPU and
// CUDA RMSNorm kernels.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

namespace d9d::kernels::detail {

/// The input seen as a [rows, cols] matrix (cols = the normalised last dimension).
struct RowShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

/// The output's dtype: `out_dtype` when given, else the input's.
at::ScalarType rms_norm_output_dtype(const at::Tensor& input,
                                     std::optional<at::ScalarType> out_dtype);

/// Checks rms_norm_forward's arguments (same device, weight [n] with n = input.size(-1), a
/// floating input, and dtypes (input, weight, output) one of the combinations rms_norm.hpp lists);
/// raises a c10::Error naming the argument otherwise.
RowShape check_rms_norm_forward(const at::Tensor& input, const at::Tensor& weight,
                                at::ScalarType output);

/// Checks rms_norm_backward's arguments against each other (shapes, dtypes, devices); the
/// gradient's dtype is the forward output's.
RowShape check_rms_norm_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                 const at::Tensor& weight, const at::Tensor& rstd);

/// The dtype of rstd and of all accumulation: double for double inputs, float otherwise.
at::ScalarType accumulate_dtype(at::ScalarType input);

/// Calls fn(T{}, W{}, O{}) with the C++ types of the input, weight and output dtypes, for the
/// combinations check_rms_norm_forward accepts: all three the same; a bfloat16 or half input and
/// output with a float32 weight; a float32 input and weight with a bfloat16 or half output.
template <class Fn>
void dispatch_rms_norm_types(at::ScalarType input, at::ScalarType weight, at::ScalarType output,
                             Fn&& fn) {
  if (input == weight && input == output) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input, "d9d::rms_norm",
                                    [&] { fn(scalar_t{}, scalar_t{}, scalar_t{}); });
  } else if (weight == at::kFloat && input == output) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(input, "d9d::rms_norm",
                                       [&] { fn(scalar_t{}, float{}, scalar_t{}); });
  } else if (input == at::kFloat && weight == at::kFloat) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(output, "d9d::rms_norm",
                                       [&] { fn(float{}, float{}, scalar_t{}); });
  } else {
    TORCH_CHECK(false, "d9d::rms_norm: no kernel for input ", input, ", weight ", weight,
                ", output ", output);
  }
}

}  // namespace d9d::kernels::detail
