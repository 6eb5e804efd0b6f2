// Build-failure test: sequence parallelism is not implemented yet.
// expect-error: d9d::parallel::TensorParallel<true>: sequence parallelism is not implemented yet
// expect-error: Fix: use d9d::parallel::TensorParallel<>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::tp<2>>, d9d::parallel::TensorParallel<true>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
