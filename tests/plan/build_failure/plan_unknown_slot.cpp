// Build-failure test: a policy whose d9d_slot is not one of the d9d::slot tags.
// expect-error: d9d::Plan: the policy's d9d_slot is not a slot of d9d::Plan
// expect-error: Fix: name one of the d9d::slot tags (d9d/plan/slots.hpp)
#include <d9d/plan/plan.hpp>

struct MySchedule {
  using d9d_slot = int;
};
using MyPlan = d9d::Plan<MySchedule>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
