// Build-failure test: a plan the trainer cannot run yet says so and how to fix it.
// expect-error: d9d::TrainStep: only d9d::parallel::Replicate data parallelism is supported so far.
// Fix: use d9d::parallel::Replicate
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<d9d::parallel::Fsdp>> trainer(
      ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, d9d::CausalLmTask{}, cfg);
}
