// Build-failure test: the empty string names no module.
// expect-error: d9d::peft::Lora: a target is the empty string, which names no module
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "">>;

int main() { return MyPlan::peft::rank; }
