// Build-failure test: TensorParallel on a mesh whose tp is statically 1 has nothing to split.
// expect-error: d9d::parallel::TensorParallel: the plan's mesh fixes tp = 1
// expect-error: Fix: give the mesh d9d::tp<N> with N > 1
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan =
    d9d::Plan<d9d::mesh<d9d::dp_replicate<4>, d9d::tp<1>>, d9d::parallel::TensorParallel<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
