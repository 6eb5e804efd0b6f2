// Build-failure test: a task whose compute_loss does not return d9d::LossOutput.
// expect-error: d9d::Trainer: the task needs `d9d::LossOutput compute_loss(Model&, const Batch&)`
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

struct TensorTask {
  using train_task_concept = d9d::train_task_tag;
  at::Tensor compute_loss(d9d::model::Qwen3ForCausalLM& model, const d9d::CausalLmBatch& batch);
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                                    TensorTask{}, cfg);
}
