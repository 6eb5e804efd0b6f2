// d9d/precision/policies.hpp — precision policies: the dtypes of parameters, compute and gradient
// reduction.
//
//   using MyPlan = d9d::Plan<d9d::precision::Bf16Mixed>;
//   static_assert(std::is_same_v<MyPlan::precision, d9d::precision::Bf16Mixed>);
//   static_assert(std::is_same_v<d9d::Plan<>::precision, d9d::precision::Fp32>);  // the default
//
// Each models d9d::plan_policy for d9d::slot::precision. Tags for now: the training step is
// specialised on them.
#pragma once

#include <d9d/plan/slots.hpp>

namespace d9d::precision {

/// Parameters, compute and gradients in float32. The default of the precision slot.
struct Fp32 {
  using d9d_slot = slot::precision;
};

/// Mixed precision: float32 master parameters, bfloat16 compute, float32 gradient reduction.
struct Bf16Mixed {
  using d9d_slot = slot::precision;
};

}  // namespace d9d::precision
