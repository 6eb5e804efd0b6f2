// Build-failure test: Freeze without a pattern would freeze nothing.
// expect-error: d9d::peft::Freeze<patterns...>: no pattern, so nothing would be frozen
// expect-error: Fix: name what to freeze, e.g. d9d::peft::Freeze<
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Freeze<>>;

int main() { return static_cast<int>(MyPlan::peft::kind); }
