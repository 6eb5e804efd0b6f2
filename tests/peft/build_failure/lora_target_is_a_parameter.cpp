// Build-failure test: LoRA targets name modules, not their parameters.
// expect-error: d9d::peft::Lora: a target names a parameter (it ends in .weight or .bias)
// expect-error: Fix: name the module, e.g.
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "*.q_proj.weight">>;

int main() { return MyPlan::peft::rank; }
