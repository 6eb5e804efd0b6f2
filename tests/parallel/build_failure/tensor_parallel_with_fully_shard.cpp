// Build-failure test: TensorParallel with FullyShard (tp x dp_shard) is not supported yet.
// expect-error: d9d::parallel::TensorParallel: FullyShard
// expect-error: is not supported with tensor parallelism yet
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<2>, d9d::tp<2>>, d9d::parallel::TensorParallel<>,
                         d9d::parallel::Fsdp>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
