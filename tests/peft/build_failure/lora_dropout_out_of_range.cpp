// Build-failure test: dropout is a percentage below 100.
// expect-error: d9d::peft::Lora<...>::with_dropout<P>: P is a percentage from 0 to 99
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "*.q_proj">::with_dropout<100>>;

int main() { return MyPlan::peft::dropout_percent; }
