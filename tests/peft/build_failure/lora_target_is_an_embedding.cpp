// Build-failure test: the embedding is not a linear layer either.
// expect-error: d9d::peft::Lora: a target names an embedding or a norm (embed_tokens, *norm)
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "model.embed_tokens">>;

int main() { return MyPlan::peft::rank; }
