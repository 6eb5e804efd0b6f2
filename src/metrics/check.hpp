// src/metrics/check.hpp — input-checking helpers of d9d::metrics (private).
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace d9d::metrics::detail {

/// "[2, 3]" for a tensor of that shape ("[]" for a scalar).
inline std::string shape_text(const at::Tensor& tensor) {
  std::string out = "[";
  for (int64_t i = 0; i < tensor.dim(); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(tensor.size(i));
  }
  return out + "]";
}

}  // namespace d9d::metrics::detail
