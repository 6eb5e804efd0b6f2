// d9d/train/train_step.hpp — the whole-model step: one rank's optimizer step when the Plan has no
// pipeline schedule (step_component<d9d::pipeline::NoPipeline>).
//
//   d9d::TrainStep<MyPlan> step(mesh, model.ptr(), loss_of_microbatch, options);
//   d9d::StepResult r = step.run(microbatches, /*step=*/0);   // r.loss: global token mean
//
// TrainStep<Plan> checks the plan (every strategy's compile-time rules, the precision policy) and
// applies its strategies to the model through the parallelize layer
// (d9d/parallel/parallelize.hpp), then runs steps over what that layer recorded: zero the
// gradients; forward and backward every microbatch (sum losses, accumulate gradients) while the
// strategies' gradient paths reduce (Replicate: bucketed all-reduce in the last backward;
// FullyShard: per-unit gathers and reduce-scatters); then the loss totals are summed over the
// strategies' loss dims (dp) and the gradients are divided by the global loss weight (so the loss
// is the token mean over every microbatch of every data-parallel rank), their norm is computed
// over the mesh and clipped, and AdamW updates each rank's parameters (the shards, under
// FullyShard). A step whose global loss or gradient norm is NaN or infinite on any rank skips the
// optimizer on every rank (StepResult::finite is false; the parameters and AdamW's state stay as
// they were). Non-template work lives in detail::TrainStepCore (compiled once,
// src/train/train_step.cpp). Trainer<Plan> builds the same step through
// step_component<NoPipeline>::train_step.
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/step.hpp>

namespace d9d {

namespace detail {

/// The whole-model step (compiled once, src/train/train_step.cpp).
class TrainStepCore final : public StepCore {
 public:
  /// `model`: the parallelize layer's result for the step's model (its one module);
  /// `contributions`: the strategies' (the loss totals are summed over its loss dims).
  TrainStepCore(std::unique_ptr<parallel::ParallelModel> model, MicrobatchLoss loss,
                TrainStepOptions options, const parallel::StepContributions& contributions);
  ~TrainStepCore() override;
  TrainStepCore(const TrainStepCore&) = delete;
  TrainStepCore& operator=(const TrainStepCore&) = delete;
  TrainStepCore(TrainStepCore&&) = delete;
  TrainStepCore& operator=(TrainStepCore&&) = delete;

  StepResult run(const std::vector<std::any>& microbatches, int64_t step) override;
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> modules() const override;
  [[nodiscard]] std::shared_ptr<torch::nn::Module> whole_model() const override;
  [[nodiscard]] parallel::ParallelModel& parallel() override;
  [[nodiscard]] torch::optim::Optimizer& optimizer() override;
  ExportResult export_model(const ExportRequest& request) override;
  [[nodiscard]] std::string describe() const override { return ""; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The config rules of the whole-model step: "logging.pipeline_timeline_step" draws a pipeline
/// program (ConfigError naming the fix).
void check_whole_model_config(const TrainerConfig& config);

/// `options` for CUDA graphs' errors: a ConfigError naming "cuda_graphs" for the
/// std::invalid_argument TrainStepCore's constructor throws when they cannot run.
std::unique_ptr<StepCore> make_whole_model_step(std::unique_ptr<parallel::ParallelModel> model,
                                                MicrobatchLoss loss, TrainStepOptions options,
                                                const parallel::StepContributions& contributions);

}  // namespace detail

/// The whole model on every rank (see the file comment).
template <>
struct step_component<pipeline::NoPipeline> {
  /// A static pp must be 1.
  template <class Plan>
  static constexpr void check() {
    static_assert(
        !Plan::mesh::well_formed || Plan::mesh::pp::is_dynamic || Plan::mesh::pp::value == 1,
        "d9d::TrainStep: the plan's mesh has pp > 1 but no pipeline schedule. Fix: put "
        "a schedule in the plan (e.g. d9d::pipeline::OneFOneB<>), or drop d9d::pp from "
        "the mesh");
  }
  /// A resolved pp must be 1.
  static void check_mesh(const MeshShape& shape) {
    parallel::detail::require_degree_one("pp", shape.pp, "d9d::pipeline::NoPipeline",
                                         "set \"mesh.pp\" to 1 or put a schedule in the plan");
  }

  /// This rank's modules: the whole model (the provider's module holder).
  template <class ModelProvider>
  struct Modules {
    model_of_t<ModelProvider> model;
    [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> list() const {
      return {model.ptr()};
    }
  };
  template <class ModelProvider>
  static constexpr bool builds = model_provider<ModelProvider>;

  /// The whole model from the provider, from the run's seed on every rank (replicas then take dp
  /// rank 0's values in the parallelize layer).
  template <class Plan, class ModelProvider>
  static Modules<ModelProvider> build(ModelProvider& models, const StepBuildInputs& in) {
    torch::manual_seed(in.config.run.seed);
    return {models.build(ModelBuildContext{.device = in.context.device(),
                                           .mesh = &in.mesh,
                                           .config_json = in.config.section("model")})};
  }

  /// The training step over the composed model: each microbatch's loss is the task's
  /// compute_loss on the microbatch as the strategies shard it; `after_microbatch` (the task's
  /// metrics) runs after it, outside CUDA graphs.
  template <class Task, class Batch, class ModelProvider>
  requires train_task_computes_loss<Task, model_of_t<ModelProvider>, Batch>
  static std::unique_ptr<detail::StepCore> train_step(
      Composition<Modules<ModelProvider>> composed, std::shared_ptr<Task> task,
      std::function<void(const LossOutput&, const std::any&)> after_microbatch,
      const TrainerConfig& config, TrainStepOptions options) {
    detail::check_whole_model_config(config);
    options.after_microbatch = std::move(after_microbatch);
    options.copier = microbatch_copier<Batch>();
    MicrobatchLoss loss = [model = composed.modules.model, task,
                           contributions = composed.contributions](const std::any& mb) mutable {
      return detail::with_sharded<Batch>(
          contributions, mb, [&](const Batch& batch) { return task->compute_loss(model, batch); });
    };
    return detail::make_whole_model_step(std::move(composed.parallel), std::move(loss),
                                         std::move(options), composed.contributions);
  }

  /// The forward step of d9d::Inference: the task's infer(Model&, const Batch&) per microbatch
  /// (one row per sample), concatenated.
  template <class Task, class Batch, class ModelProvider>
  static ForwardStep forward_step(Composition<Modules<ModelProvider>> composed,
                                  std::shared_ptr<Task> task) {
    static_assert(
        requires(Task & t, model_of_t<ModelProvider> & m, const Batch& b) {
          { t.infer(m, b) } -> std::convertible_to<at::Tensor>;
        },
        "d9d::Inference: the task needs `at::Tensor infer(Model&, const Batch&)` giving one row "
        "per sample of the batch");
    ForwardStep out{.parallel = std::move(composed.parallel), .run = {}, .stages_elsewhere = false};
    out.run = [model = composed.modules.model, task, contributions = composed.contributions](
                  const std::vector<std::any>& microbatches) mutable {
      std::vector<at::Tensor> rows;
      rows.reserve(microbatches.size());
      for (const auto& microbatch : microbatches) {
        rows.push_back(detail::with_sharded<Batch>(
            contributions, microbatch,
            [&](const Batch& batch) -> at::Tensor { return task->infer(model, batch); }));
      }
      return at::cat(rows, 0);
    };
    return out;
  }
};

/// One rank's optimizer step for `Plan` (see the file comment). The model must be the whole model
/// (a pipeline plan runs through Trainer<Plan>).
template <class Plan>
class TrainStep {
 public:
  TrainStep(const DeviceMesh& mesh, std::shared_ptr<torch::nn::Module> model, MicrobatchLoss loss,
            TrainStepOptions options, parallel::ParallelizeOptions parallel = {})
      : core_(make(mesh, std::move(model), std::move(parallel)), std::move(loss),
              with_plan(std::move(options)), parallel::step_contributions<Plan>()) {}

  /// One optimizer step over this rank's microbatches (collective over the mesh).
  StepResult run(const std::vector<std::any>& microbatches, int64_t step) {
    return core_.run(microbatches, step);
  }
  [[nodiscard]] std::shared_ptr<torch::nn::Module> model() const { return core_.whole_model(); }
  /// The parallelize layer's result: parameter records (what the optimizer updates, placements).
  [[nodiscard]] parallel::ParallelModel& parallel() { return core_.parallel(); }
  /// The optimizer (AdamW) over the records' local tensors (checkpoints read and restore it).
  [[nodiscard]] torch::optim::Optimizer& optimizer() { return core_.optimizer(); }

 private:
  static std::unique_ptr<parallel::ParallelModel> make(const DeviceMesh& mesh,
                                                       std::shared_ptr<torch::nn::Module> model,
                                                       parallel::ParallelizeOptions parallel) {
    static_assert(!plan_has_pipeline<Plan>,
                  "d9d::TrainStep: runs the whole model on each rank; pipeline plans run through "
                  "d9d::Trainer<Plan>");
    step_component<pipeline::NoPipeline>::check<Plan>();
    (void)detail::precision_options<Plan>();
    step_component<pipeline::NoPipeline>::check_mesh(mesh.shape());
    return parallel::parallelize<Plan>(mesh, {std::move(model)}, std::move(parallel));
  }
  static TrainStepOptions with_plan(TrainStepOptions options) {
    detail::precision_options<Plan>().apply_to(options);
    return options;
  }

  detail::TrainStepCore core_;
};

}  // namespace d9d
