// Build-failure test: d9d::plan_with_t with a bare mesh degree instead of a d9d::mesh<...>.
// expect-error: d9d::plan_with_t: a mesh degree or d9d::world is not a plan policy
// expect-error: Fix: put it inside d9d::mesh<...>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::plan_with_t<d9d::Plan<>, d9d::dp_shard<4>>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
