// Build-failure test: ContextParallel over a mesh that fixes cp_shard = cp_replicate = 1.
// expect-error: d9d::parallel::ContextParallel: the plan's mesh fixes cp_shard = cp_replicate = 1
// expect-error: Fix: give the mesh d9d::cp_shard<N> with N > 1
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<2>>, d9d::parallel::ContextParallel<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
