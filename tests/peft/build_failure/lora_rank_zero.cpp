// Build-failure test: a rank-0 adapter adds nothing and trains nothing.
// expect-error: d9d::peft::Lora<Rank, Alpha, targets...>: Rank must be >= 1
// expect-error: Fix: give a rank such as d9d::peft::Lora<8, 16,
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<0, 16, "*.q_proj">>;

int main() { return MyPlan::peft::rank; }
