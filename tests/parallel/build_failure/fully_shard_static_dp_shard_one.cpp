// Build-failure test: FullyShard on a mesh whose dp_shard is statically 1 has nothing to shard.
// expect-error: d9d::parallel::FullyShard: the plan's mesh fixes dp_shard = 1
// expect-error: Fix: give the mesh d9d::dp_shard<N> with N > 1
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<1>, d9d::dp_replicate<4>>, d9d::parallel::Fsdp>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
