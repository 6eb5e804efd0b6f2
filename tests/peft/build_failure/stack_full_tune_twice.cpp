// Build-failure test: FullTune twice in a stack.
// expect-error: d9d::peft::Stack: d9d::peft::FullTune is given more than once
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan =
    d9d::Plan<d9d::peft::Stack<d9d::peft::Lora<8, 16>, d9d::peft::FullTune, d9d::peft::FullTune>>;

int main() { return static_cast<int>(MyPlan::peft::size); }
