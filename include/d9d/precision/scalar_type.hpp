// d9d/precision/scalar_type.hpp — the LibTorch dtype of a precision policy's Dtype.
//
//   static_assert(d9d::precision::scalar_type(d9d::precision::Dtype::bfloat16) == at::kBFloat16);
//   at::ScalarType parameters = d9d::precision::scalar_type(MyPlan::precision::parameters);
//
// Precision policies state their dtypes as d9d::precision::Dtype (d9d/plan/defaults.hpp, free of
// LibTorch headers); the code that allocates and casts tensors (parallelize, the training step)
// asks this function. Needs only <c10/core/ScalarType.h>.
#pragma once

#include <c10/core/ScalarType.h>

#include <d9d/plan/defaults.hpp>  // Dtype

namespace d9d::precision {

/// float32 -> at::kFloat, float64 -> at::kDouble, bfloat16 -> at::kBFloat16.
constexpr c10::ScalarType scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::float64:
      return c10::ScalarType::Double;
    case Dtype::bfloat16:
      return c10::ScalarType::BFloat16;
    case Dtype::float32:
      break;
  }
  return c10::ScalarType::Float;
}

}  // namespace d9d::precision
