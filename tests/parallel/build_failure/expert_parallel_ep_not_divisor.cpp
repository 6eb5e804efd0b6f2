// Build-failure test: a static expert count that a static ep does not divide (6 experts, ep 4).
// expect-error: d9d::parallel::ExpertParallel<NumExperts>: ep does not divide the number of experts
// expect-error: experts_divide_over<6, 4>
// expect-error: Fix: choose ep among the divisors of NumExperts
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<4>, d9d::ep<4>>, d9d::parallel::ExpertParallel<6>>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
