// d9d/train/detail/build.hpp — what Trainer<Plan> and Inference<Plan> both build from a config
// before their loops: the plan's mesh, the provider's checkpoint mapper, a pipeline rank's stages
// and the weights of "checkpoint.init_from". Not a public API.
//
//   auto mesh = d9d::detail::make_plan_mesh<Plan>(context, config);
//   auto built = d9d::detail::build_rank_stages(models, context, *mesh, config, program);
//   d9d::detail::load_init_from(context, *parallel, config.checkpoint.init_from,
//                               d9d::detail::hf_load_mapper_of(models), "initial weights");
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/utils.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/plan/mesh.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d::detail {

/// The plan's mesh against the world (dynamic degrees from the config's "mesh" section), the
/// batch against the mesh: checked before anything is allocated. A mesh that does not fit is a
/// ConfigError.
template <class Plan>
std::shared_ptr<const DeviceMesh> make_plan_mesh(const DistributedContext& context,
                                                 const TrainerConfig& config) {
  MeshShape shape;
  try {
    shape = resolve_mesh<typename Plan::mesh>(context.world_size(), config.mesh);
    check_step_mesh<Plan>(shape);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::invalid_argument& error) {
    throw ConfigError(std::string("d9d config: ") + error.what());
  }
  auto mesh = std::make_shared<const DeviceMesh>(context, shape);
  config.check_against_data_parallel(mesh->size(MeshDomain::batch, "dp"));
  return mesh;
}

/// Checkpoint keys and this rank's parameter names -> the mapper that loads them.
using HfLoadMapper = std::function<state::Mapper(const std::vector<std::string>& source_keys,
                                                 const std::vector<std::string>& names)>;

/// The provider's hf_load_mapper, if it has one (empty otherwise: names map as they are). Take it
/// after the model is built: the provider may need the model's config for it.
template <class ModelProvider>
HfLoadMapper hf_load_mapper_of(const ModelProvider& models) {
  if constexpr (requires(const std::vector<std::string>& keys) {
                  { models.hf_load_mapper(keys, keys) } -> std::convertible_to<state::Mapper>;
                }) {
    return [models](const std::vector<std::string>& source_keys,
                    const std::vector<std::string>& names) {
      return models.hf_load_mapper(source_keys, names);
    };
  } else {
    return {};
  }
}

/// Pipeline plans size the tensors between stages with "batch.sequence_length": a ConfigError
/// naming the fix when it is not given.
void require_sequence_length(const TrainerConfig& config);

/// This rank's stages of a program, each with its forward, and the activation spec of every
/// boundary they touch (sizes for one microbatch; the dtype is the executor's to set).
struct RankStages {
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>> stages;
  std::function<pipeline::TensorSpec(int stage)> activation;
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
};

/// Builds the stages `program` places on this rank (pp coordinate) with the provider's
/// build_stage. Each stage starts from the run's seed, as the whole model does: with a provider
/// whose initialisation depends on that and the names only (d9d::model::init_qwen3_parameters),
/// each stage starts with the whole model's values.
template <class ModelProvider>
RankStages build_rank_stages(ModelProvider& models, const DistributedContext& context,
                             const DeviceMesh& mesh, const TrainerConfig& config,
                             const pipeline::Program& program) {
  using StageModule = stage_of_t<ModelProvider>;
  RankStages out;
  std::map<int, pipeline::TensorSpec> specs;
  const int64_t b = config.batch.microbatch_size;
  const int64_t t = config.batch.sequence_length;
  const int rank = mesh.coordinate(MeshDomain::regular, "pp");
  for (const int s :
       pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank, rank)) {
    torch::manual_seed(config.run.seed);
    StageModule stage = models.build_stage(StageBuildContext{.device = context.device(),
                                                             .mesh = &mesh,
                                                             .config_json = config.section("model"),
                                                             .stage = s,
                                                             .stages = program.stages()});
    specs[s] = {.sizes = stage->input_sizes(b, t)};
    specs[s + 1] = {.sizes = stage->output_sizes(b, t)};
    out.stages.emplace_back(
        stage.ptr(), pipeline::Stage{.index = s, .forward = [stage](const at::Tensor& x) mutable {
                                       return stage->forward(x);
                                     }});
  }
  out.activation = [specs](int s) {
    const auto it = specs.find(s);
    if (it == specs.end()) {
      throw std::logic_error("d9d: no activation spec for stage " + std::to_string(s) +
                             " on this rank");
    }
    return it->second;
  };
  return out;
}

/// The dtype activations cross stages in: that of the stages' floating-point parameters (what
/// the residual stream computes in; bf16 autocast keeps it there too), i.e. the precision's
/// parameter dtype or the compute dtype of parameters a sharding strategy gathers; float when
/// the stages have none.
at::ScalarType stage_activation_dtype(
    const std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>>& stages);

/// "checkpoint.init_from" streamed into the parallelised model (parallel::load_state), each rank
/// reading and copying only its parts, through `mapper` (empty: names as they are). A name held
/// on two of this rank's stages (a tied embedding) loads once; LoRA adapters keep their initial
/// values (the checkpoint is the base); under a pipeline the other stages' keys stay unread.
/// Errors become a ConfigError naming the key; the main rank logs "<what> from <from>: ...".
void load_init_from(const DistributedContext& context, parallel::ParallelModel& parallel,
                    const std::string& from, const HfLoadMapper& mapper, const std::string& what);

}  // namespace d9d::detail
