// Build-failure test: alpha 0 scales the adapter's output to nothing.
// expect-error: d9d::peft::Lora<Rank, Alpha, targets...>: Alpha must be >= 1
// expect-error: Fix: Alpha = 2 * Rank is a common choice
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 0, "*.q_proj">>;

int main() { return MyPlan::peft::alpha; }
