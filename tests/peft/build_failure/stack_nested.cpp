// Build-failure test: stacks do not nest.
// expect-error: d9d::peft::Stack: a stack inside a stack
// expect-error: Fix: list every method in one d9d::peft::Stack<...>
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using Inner = d9d::peft::Stack<d9d::peft::Lora<8, 16, "*.q_proj">>;
using MyPlan = d9d::Plan<d9d::peft::Stack<Inner, d9d::peft::Train<"*norm">>>;

int main() { return static_cast<int>(MyPlan::peft::size); }
