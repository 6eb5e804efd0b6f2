// Build-failure test: a task that declares metrics() but has no update_metrics for its batch.
// expect-error: d9d::Trainer: the task declares metrics() but has no `void update_metrics(
// expect-error: d9d::metrics::MetricCollection& metrics)` for the dataset's batch type
#include <map>
#include <string>

#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

// What the trainer needs of a collection (d9d::metrics::MetricCollection has it).
struct Collection {
  void reset();
  void sync_start(const d9d::ProcessGroup& group);
  void sync_wait();
  std::map<std::string, double> compute_synced();
};

struct MetricsOnlyTask : d9d::CausalLmTask {
  [[nodiscard]] Collection metrics() const;
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                                    MetricsOnlyTask{}, cfg);
}
