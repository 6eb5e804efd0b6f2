// Build-failure test: a stack of something that is not a PEFT method.
// expect-error: d9d::peft::Stack: an argument is not a PEFT method d9d implements
// expect-error: Fix: use d9d::peft::FullTune, Freeze<...>, Train<...> and Lora<...>
#include <d9d/parallel/policies.hpp>
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Stack<d9d::peft::Lora<8, 16>, d9d::parallel::Fsdp>>;

int main() { return static_cast<int>(MyPlan::peft::size); }
