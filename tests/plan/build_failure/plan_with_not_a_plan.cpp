// Build-failure test: d9d::plan_with_t with its arguments swapped (the plan comes first).
// expect-error: d9d::plan_with_t: the first argument is not a d9d::Plan<...>
// expect-error: Fix: pass the plan first and the new policy second
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::plan_with_t<d9d::parallel::Replicate, d9d::Plan<>>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
