// Build-failure test: a strategy of one's own that lacks a part of d9d::parallel::parallel_strategy
// is named by the part it lacks (here its start-up rules, check_mesh).
// expect-error: d9d::parallel::strategy<Policy>: lacks `static void check_mesh(const
// expect-error: d9d::MeshShape&)` (its start-up rules for d9d::dynamic degrees
// expect-error: strategy_checks_mesh
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

struct MyContextParallel {
  using d9d_slot = d9d::slot::context_parallel;
};

template <>
struct d9d::parallel::strategy<MyContextParallel> {
  using strategy_concept = d9d::parallel::strategy_tag;
  template <class Plan>
  static constexpr void check() {}
  template <class Plan>
  static void apply(d9d::parallel::ParallelModel& /*model*/) {}
};

int main() {
  d9d::parallel::check_plan<d9d::Plan<MyContextParallel>>();
  return 0;
}
