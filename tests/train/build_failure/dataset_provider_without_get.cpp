// Build-failure test: a dataset whose batches cannot be fetched by index.
// expect-error: d9d::Trainer: the dataset provider needs `build(const d9d::DataBuildContext&)`
// returning a dataset with `int64_t size()` and `get(const std::vector<int64_t>& indices)`
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

struct SizeOnly {
  int64_t size() const;
};
struct Provider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  SizeOnly build(const d9d::DataBuildContext& context);
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, d9d::Qwen3Provider{}, Provider{}, d9d::CausalLmTask{},
                                    cfg);
}
