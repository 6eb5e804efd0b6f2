// Build-failure test: a type without the opt-in tag passed to d9d::Plan.
// expect-error: d9d::Plan: an argument is not a plan policy
// expect-error: plan_dependent_false<MySchedule>
// expect-error: declare using d9d_slot = d9d::slot::<slot>; in your policy
#include <d9d/plan/plan.hpp>

struct MySchedule {};
using MyPlan = d9d::Plan<d9d::mesh<d9d::pp<2>>, MySchedule>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
