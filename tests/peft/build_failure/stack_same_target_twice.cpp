// Build-failure test: a stack whose LoRA and Freeze both claim "*.q_proj".
// expect-error: d9d::peft::Stack: two methods claim the same target pattern
// expect-error: Fix: give each pattern to one method
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Stack<d9d::peft::Lora<8, 16, "*.q_proj", "*.v_proj">,
                                          d9d::peft::Freeze<"*.q_proj">>>;

int main() { return static_cast<int>(MyPlan::peft::size); }
