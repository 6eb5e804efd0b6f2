// Build-failure test: under a pipeline plan the task must split its loss across the stages.
// expect-error: d9d::Trainer: a pipeline plan needs the task's `at::Tensor stage_input(const
// expect-error: `d9d::LossOutput output_loss(const
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

// Whole-model loss only: fine without a pipeline, not with one.
struct WholeModelTask {
  using train_task_concept = d9d::train_task_tag;
  d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& model,
                               const d9d::CausalLmBatch& batch);
};

using Plan = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>>, d9d::pipeline::OneFOneB<>>;

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, WholeModelTask{},
                             cfg);
}
