// Build-failure test: the Trainer rejects a dataset whose batch type it cannot split into
// microbatches, with one error naming the fix.
// expect-error: d9d::Trainer: the dataset's batch type holds no tensor the library can split
// expect-error: Fix: make the struct a plain aggregate
#include <cstdint>
#include <utility>
#include <vector>

#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

class Opaque {  // a constructor and private members: neither an aggregate nor adapted
 public:
  explicit Opaque(at::Tensor x) : x_(std::move(x)) {}
  [[nodiscard]] const at::Tensor& x() const { return x_; }

 private:
  at::Tensor x_;
};

struct Data {
  [[nodiscard]] int64_t size() const { return 1; }
  [[nodiscard]] Opaque get(const std::vector<int64_t>& /*indices*/) const { return Opaque{{}}; }
};
struct DataProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  [[nodiscard]] Data build(const d9d::DataBuildContext& /*context*/) const { return {}; }
};
struct Task {
  using train_task_concept = d9d::train_task_tag;
  d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& /*model*/, const Opaque& /*b*/) {
    return {};
  }
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, d9d::Qwen3Provider{}, DataProvider{}, Task{}, cfg);
}
