// Build-failure test: a bfloat16 reduction of float32 gradients only loses precision.
// expect-error: d9d::parallel::FullyShard: ReduceDtype::bfloat16 needs bfloat16 compute
// expect-error: Fix: use d9d::precision::Bf16Mixed
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using Sharding = d9d::parallel::FullyShard<d9d::parallel::Reshard::after_forward,
                                           d9d::parallel::ReduceDtype::bfloat16>;
using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<4>>, Sharding, d9d::precision::Fp32>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
