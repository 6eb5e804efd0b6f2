// Build-failure test: context parallelism under a pipeline schedule is not implemented yet.
// expect-error: d9d::parallel::ContextParallel: context parallelism under a pipeline schedule
// expect-error: Fix: drop the schedule, or use d9d::parallel::NoContextParallel
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::pp<2>, d9d::cp_shard<2>>, d9d::parallel::ContextParallel<>,
                         d9d::pipeline::OneFOneB<>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
