// Build-failure test: LoRA wraps linear layers; a norm (or an embedding) is a kind it cannot wrap.
// expect-error: d9d::peft::Lora: a target names an embedding or a norm (embed_tokens, *norm)
// expect-error: Fix: target linear layers, and train norms or embeddings with
#include <d9d/peft/policies.hpp>
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::peft::Lora<8, 16, "*.q_proj", "*.input_layernorm">>;

int main() { return MyPlan::peft::rank; }
