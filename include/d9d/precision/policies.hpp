// d9d/precision/policies.hpp — precision policies: the dtypes of parameters, compute and gradient
// reduction.
//
//   using MyPlan = d9d::Plan<d9d::precision::Bf16Mixed>;
//   static_assert(MyPlan::precision::compute == d9d::precision::Dtype::bfloat16);
//   static_assert(std::is_same_v<d9d::Plan<>::precision, d9d::precision::Fp32>);  // the default
//
// Each models d9d::plan_policy for d9d::slot::precision and states its facts as members:
// `parameters` (the dtype the optimizer updates), `compute` (the dtype of the forward's matrix
// products: the parameters' own, or bf16 under autocast) and `reduce` (the dtype gradients are
// reduced in). The training steps read those facts; nothing branches on the policy's name.
#pragma once

#include <d9d/plan/defaults.hpp>  // Dtype and Fp32, the default

namespace d9d::precision {

/// Mixed precision: float32 master parameters, bfloat16 compute (autocast), float32 gradient
/// reduction.
struct Bf16Mixed {
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::float32;
  static constexpr Dtype compute = Dtype::bfloat16;
  static constexpr Dtype reduce = Dtype::float32;
};

/// Parameters, compute and gradients in float64: a reference precision for numerical checks, not
/// for speed. A parallel run and a single-process run of the same plan differ only by the
/// summation order of their reductions; in float64 that is ~1e-16 relative, so their equality can
/// be tested tightly even after AdamW, whose normalised update magnifies the float32 rounding of
/// tiny gradients (tests/train: the multi-process equality tests).
struct Fp64 {
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::float64;
  static constexpr Dtype compute = Dtype::float64;
  static constexpr Dtype reduce = Dtype::float64;
};

}  // namespace d9d::precision
