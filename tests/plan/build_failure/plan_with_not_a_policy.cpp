// Build-failure test: d9d::plan_with_t with a new "policy" that is not one.
// expect-error: d9d::plan_with_t: the new policy is not a plan policy
// expect-error: plan_dependent_false<MySchedule>
#include <d9d/plan/plan.hpp>

struct MySchedule {};
using MyPlan = d9d::plan_with_t<d9d::Plan<>, MySchedule>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
