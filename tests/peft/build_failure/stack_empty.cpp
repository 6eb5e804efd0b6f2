// Build-failure test: an empty stack.
// expect-error: d9d::peft::Stack<>: an empty stack
// expect-error: or use d9d::peft::FullTune
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Stack<>>;

int main() { return static_cast<int>(MyPlan::peft::size); }
