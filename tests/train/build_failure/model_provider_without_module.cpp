// Build-failure test: a model provider whose build() returns no module holder.
// expect-error: d9d::Trainer: the model provider needs `build(const d9d::ModelBuildContext&)`
// returning a module holder
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

struct ReturnsInt {
  using model_provider_concept = d9d::model_provider_tag;
  int build(const d9d::ModelBuildContext& context);
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, ReturnsInt{}, d9d::TokenFilesProvider{},
                                    d9d::CausalLmTask{}, cfg);
}
