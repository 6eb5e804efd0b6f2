// Build-failure test: Bf16Compute reduces gradients in float32 or bfloat16, nothing else.
// expect-error: d9d::precision::Bf16Compute<Reduce>: gradients are reduced in float32 or bfloat16
// expect-error: Fix: Bf16Compute<> (= Bf16Mixed) or Bf16Compute<Dtype::bfloat16>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using Precision = d9d::precision::Bf16Compute<d9d::precision::Dtype::float64>;
using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<2>>, Precision>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
