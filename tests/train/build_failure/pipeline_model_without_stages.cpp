// Build-failure test: under a pipeline plan the model provider must build stages.
// expect-error: d9d::Trainer: a pipeline plan needs the model provider's `build_stage(const
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

// Builds the whole model only.
struct WholeModelProvider {
  using model_provider_concept = d9d::model_provider_tag;
  d9d::model::Qwen3ForCausalLM build(const d9d::ModelBuildContext& context);
};

using Plan = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>>, d9d::pipeline::ZeroBubbleH1<>>;

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  d9d::Trainer<Plan> trainer(ctx, WholeModelProvider{}, d9d::TokenFilesProvider{},
                             d9d::CausalLmTask{}, cfg);
}
