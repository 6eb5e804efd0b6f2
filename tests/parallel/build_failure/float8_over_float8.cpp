// Build-failure test: Float8's base is a plain precision policy, not another Float8.
// expect-error: d9d::precision::Float8<S, G, Base>: Base is itself a Float8 policy
// expect-error: Fix: one Float8<...> over a plain policy (Bf16Mixed, Bf16Params<>, Fp32, Fp64)
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using Precision =
    d9d::precision::Float8<d9d::precision::Scaling::rowwise,
                           d9d::precision::WeightGather::compute_dtype, d9d::precision::Float8<>>;
using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<2>>, Precision>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
