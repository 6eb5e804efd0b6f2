// Build-failure test: sequence parallelism under a pipeline schedule is not implemented yet.
// expect-error: d9d::parallel::TensorParallel<SequenceParallel::on>: sequence parallelism under
// expect-error: Fix: use d9d::parallel::TensorParallel<>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::pp<2>, d9d::tp<2>>,
                         d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>,
                         d9d::pipeline::OneFOneB<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
