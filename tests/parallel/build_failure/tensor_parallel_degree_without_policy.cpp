// Build-failure test: a static tp degree with no tensor-parallel policy to use it.
// expect-error: d9d::parallel::NoTensorParallel: the plan's mesh has tp > 1
// expect-error: Fix: drop d9d::tp from the mesh
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<2>, d9d::tp<2>>, d9d::parallel::Fsdp>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
