// d9d/train/compose.hpp — d9d::compose<Plan>: the one place a Plan becomes this rank's composed
// model, shared by Trainer<Plan> and Inference<Plan>.
//
//   auto composed = d9d::compose<MyPlan>(context, models, config);  // collective
//   composed.mesh;            // the resolved mesh (dynamic degrees from the config's "mesh")
//   composed.microbatches;    // per rank and step
//   composed.modules;         // the whole model, or this rank's pipeline stages
//   composed.parallel;        // after the strategies (parameter records, gradient path)
//
// In order: the Plan's compile-time rules (every strategy's and the step component's), the mesh
// resolved against the world and checked once (the strategies' and the step's start-up rules),
// the strategies' contributions to the data and the loss (over which dims samples are split and
// losses summed), the batch checked against the sample split and the microbatch count computed,
// this rank's modules built by the step component of the Plan's pipeline slot (the whole model,
// or the stages the schedule's program places on this rank), and the strategies applied to them
// in order (d9d/parallel/parallelize.hpp). `Schedule` defaults to the Plan's own; Inference<Plan>
// composes a pipelined plan with the forward-only d9d::pipeline::Inference<> instead. Also here:
// the data the loops read (erase_data), "checkpoint.init_from" (load_init_from).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/mesh.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/pipeline_step.hpp>
#include <d9d/train/step.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {

namespace detail {

/// The parallelize layer's knobs from the config (the one place they are read).
parallel::ParallelizeOptions parallel_options(const TrainerConfig& config);

/// The compile-time rules of `Plan` composed with the step of `Schedule`: every strategy's, the
/// precision policy's and the step component's.
template <class Plan, class Schedule = typename Plan::pipeline>
constexpr void check_composition() {
  parallel::check_plan<Plan>();
  (void)precision_options<Plan>();
  if constexpr (Plan::mesh::well_formed) {
    step_component<Schedule>::template check<Plan>();
  }
}

/// The rules of a trainable plan: the composition's, and a schedule that trains.
template <class Plan>
constexpr void check_train_plan() {
  check_composition<Plan>();
  static_assert(!is_inference_schedule<typename Plan::pipeline>,
                "d9d::Trainer: d9d::pipeline::Inference runs forward only and cannot train. "
                "Fix: choose a training schedule (GPipe, OneFOneB, ZeroBubbleH1, ...)");
}

/// The start-up rules of the resolved mesh: every strategy's and the step component's
/// (std::invalid_argument naming the degree and the fix).
template <class Plan, class Schedule = typename Plan::pipeline>
void check_composition_mesh(const MeshShape& shape) {
  parallel::check_mesh<Plan>(shape);
  step_component<Schedule>::check_mesh(shape);
}

/// The plan's mesh against the world (dynamic degrees from the config's "mesh" section), checked
/// once before anything is allocated. A mesh that does not fit is a ConfigError.
template <class Plan, class Schedule = typename Plan::pipeline>
std::shared_ptr<const DeviceMesh> make_plan_mesh(const DistributedContext& context,
                                                 const TrainerConfig& config) {
  MeshShape shape;
  try {
    shape = resolve_mesh<typename Plan::mesh>(context.world_size(), config.mesh);
    check_composition_mesh<Plan, Schedule>(shape);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::invalid_argument& error) {
    throw ConfigError(std::string("d9d config: ") + error.what());
  }
  return std::make_shared<const DeviceMesh>(context, shape);
}

/// The step's microbatches per rank: the global batch over the ranks that read different samples
/// and the microbatch size (ConfigError when they do not divide).
int64_t microbatches_of(const TrainerConfig& config, const parallel::StepContributions& c,
                        const DeviceMesh& mesh);

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

/// "checkpoint.init_from" streamed into the parallelised model (parallel::load_state), each rank
/// reading and copying only its parts, through `mapper` (empty: names as they are). A name held
/// on two of this rank's stages (a tied embedding) loads once; LoRA adapters keep their initial
/// values (the checkpoint is the base); with `stages_elsewhere` (pipeline stages) the other
/// stages' keys stay unread. Errors become a ConfigError naming the key; the main rank logs
/// "<what> from <from>: ...".
void load_init_from(const DistributedContext& context, parallel::ParallelModel& parallel,
                    const std::string& from, const HfLoadMapper& mapper, const std::string& what,
                    bool stages_elsewhere);

/// The user's dataset behind type erasure, as both loops read it: its size, a batch of samples,
/// and a batch split into microbatches.
struct ErasedData {
  int64_t size = 0;
  std::function<std::any(const std::vector<int64_t>& indices)> load;
  std::function<std::vector<std::any>(const std::any& batch, int64_t parts)> split;
};

/// The provider's dataset for this rank (its share of the samples: the strategies' sample split),
/// erased. `Batch`: the dataset's batch type, which must split into microbatches.
template <class DatasetProvider, class Batch = batch_of_t<DatasetProvider>>
ErasedData erase_data(DatasetProvider& datasets, const DeviceMesh& mesh,
                      const parallel::StepContributions& contributions,
                      const TrainerConfig& config) {
  using Dataset = dataset_of_t<DatasetProvider>;
  const auto share = contributions.samples(mesh);
  auto dataset = std::make_shared<Dataset>(
      datasets.build(DataBuildContext{.sequence_length = config.batch.sequence_length,
                                      .seed = config.run.seed,
                                      .dp_rank = share.index,
                                      .dp_size = share.count,
                                      .config_json = config.section("data"),
                                      .model_config_json = config.section("model")}));
  ErasedData out;
  out.size = static_cast<int64_t>(dataset->size());
  out.load = [dataset](const std::vector<int64_t>& indices) -> std::any {
    return std::any(Batch(dataset->get(indices)));
  };
  if constexpr (splittable_batch<Batch>) {  // else the loop's static_assert says why
    out.split = [](const std::any& batch, int64_t parts) {
      std::vector<std::any> microbatches;
      for (auto& part : split_batch(std::any_cast<const Batch&>(batch), static_cast<int>(parts))) {
        microbatches.emplace_back(std::move(part));
      }
      return microbatches;
    };
  }
  return out;
}

}  // namespace detail

/// This rank's composition of `Plan` (see the file comment) with the step of `Schedule`.
/// Collective over the world. Errors in the config or the mesh are ConfigErrors naming the key.
template <class Plan, class Schedule = typename Plan::pipeline, class ModelProvider>
Composition<typename step_component<Schedule>::template Modules<ModelProvider>> compose(
    const DistributedContext& context, ModelProvider& models, const TrainerConfig& config) {
  using Step = step_component<Schedule>;
  detail::check_composition<Plan, Schedule>();
  auto mesh = detail::make_plan_mesh<Plan, Schedule>(context, config);
  auto contributions = parallel::step_contributions<Plan>();
  const int64_t microbatches = detail::microbatches_of(config, contributions, *mesh);
  auto modules = Step::template build<Plan>(
      models,
      StepBuildInputs{
          .context = context, .mesh = *mesh, .config = config, .microbatches = microbatches});
  auto parallel = parallel::detail::apply_strategies<Plan>(*mesh, modules.list(),
                                                           detail::parallel_options(config));
  return {.mesh = std::move(mesh),
          .contributions = std::move(contributions),
          .microbatches = microbatches,
          .modules = std::move(modules),
          .parallel = std::move(parallel)};
}

}  // namespace d9d
