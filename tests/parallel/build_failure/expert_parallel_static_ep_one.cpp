// Build-failure test: ExpertParallel on a mesh whose ep is statically 1 has nothing to split.
// expect-error: d9d::parallel::ExpertParallel: the plan's mesh fixes ep = 1
// expect-error: Fix: give the mesh d9d::ep<N> with N > 1
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<4>, d9d::ep<1>>, d9d::parallel::ExpertParallel<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
