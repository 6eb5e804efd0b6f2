// Build-failure test: a task with update_metrics but no metrics() building its collection.
// expect-error: d9d::Trainer: the task has update_metrics but no `metrics() const`
#include <map>
#include <string>

#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

struct Collection {
  void reset();
  void sync_start(const d9d::ProcessGroup& group);
  void sync_wait();
  std::map<std::string, double> compute_synced();
};

struct UpdateOnlyTask : d9d::CausalLmTask {
  void update_metrics(const d9d::LossOutput& out, const d9d::CausalLmBatch& batch,
                      Collection& metrics) const;
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                                    UpdateOnlyTask{}, cfg);
}
