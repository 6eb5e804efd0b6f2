// Build-failure test: a static pp degree needs a pipeline schedule in the plan.
// expect-error: d9d::TrainStep: the plan's mesh has pp > 1 but no pipeline schedule.
// expect-error: Fix: put a schedule in the plan
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<d9d::mesh<d9d::pp<2>>>> trainer(
      ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, d9d::CausalLmTask{}, cfg);
}
