// Build-failure test: a static mesh mistake gives one error, the mesh's own; the rules that read
// the mesh (the TrainStep's pp rule, the strategies') stay quiet while the mesh is malformed.
// expect-error: d9d::mesh: the degrees do not multiply to the declared d9d::world<N>
// expect-no-error: d9d::TrainStep: the plan's mesh has pp > 1 but no pipeline schedule
// expect-no-error: d9d::parallel::NoTensorParallel
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/trainer.hpp>

void make(d9d::DistributedContext ctx, d9d::TrainerConfig cfg) {
  using Mesh = d9d::mesh<d9d::pp<2>, d9d::dp_replicate<2>, d9d::tp<2>, d9d::world<4>>;
  d9d::Trainer<d9d::Plan<Mesh>> trainer(ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
                                        d9d::CausalLmTask{}, cfg);
}
