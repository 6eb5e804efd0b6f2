// Build-failure test: TensorParallel under a pipeline schedule is not supported yet.
// expect-error: d9d::parallel::TensorParallel: pipeline schedules are not supported
// expect-error: Fix: drop the schedule and d9d::pp from the plan
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::pp<2>, d9d::tp<2>>, d9d::parallel::TensorParallel<>,
                         d9d::pipeline::OneFOneB<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
