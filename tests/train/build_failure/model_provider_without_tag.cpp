// Build-failure test: a model provider that does not opt in is named in the Trainer's error.
// expect-error: d9d::Trainer: the model provider does not opt in. Fix: declare `using
// model_provider_concept = d9d::model_provider_tag;` in it
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

struct Untagged {
  d9d::model::Qwen3ForCausalLM build(const d9d::ModelBuildContext& context);
};

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<d9d::Plan<>> trainer(ctx, Untagged{}, d9d::TokenFilesProvider{}, d9d::CausalLmTask{},
                                    cfg);
}
