// Build-failure test: one target written twice in one adapter.
// expect-error: d9d::peft::Lora: a target is given twice
// expect-error: Fix: give each target once
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "*.q_proj", "*.v_proj", "*.q_proj">>;

int main() { return MyPlan::peft::rank; }
