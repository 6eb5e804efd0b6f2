// Build-failure test: the forward-only schedule cannot train.
// expect-error: d9d::Trainer: d9d::pipeline::Inference runs forward only and cannot train
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

using Plan = d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::Inference<>>;

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                             d9d::CausalLmTask{}, cfg);
}
