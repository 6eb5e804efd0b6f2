// Build-failure test: one pattern written twice in one method.
// expect-error: d9d::peft::Freeze / Train: a pattern is given twice
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Train<"*norm", "lm_head", "*norm">>;

int main() { return static_cast<int>(MyPlan::peft::kind); }
