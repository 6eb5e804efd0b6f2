// d9d/train/train_step.hpp — one rank's optimizer step, composed for a Plan.
//
//   d9d::TrainStep<MyPlan> step(mesh, model.ptr(), loss_of_microbatch, options);
//   d9d::StepResult r = step.run(microbatches, /*step=*/0);   // r.loss: global token mean
//
// A step: zero the gradients; forward and backward every microbatch (sum losses, accumulate
// gradients); during the last backward the data-parallel replicate reducer all-reduces gradient
// buckets as they become ready; then gradients are divided by the global loss weight (so the
// loss is the token mean over every microbatch of every data-parallel rank), the global gradient
// norm is computed and clipped, and AdamW updates the parameters with the scheduled learning rate.
// Non-template work lives in detail::TrainStepCore (compiled once, src/train/train_step.cpp);
// TrainStep<Plan> checks the plan and passes its facts down.
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d {

/// The knobs of a TrainStep (normally taken from a TrainerConfig).
struct TrainStepOptions {
  OptimizerConfig optimizer;
  std::vector<optim::Phase> lr_schedule;
  int64_t total_steps = 1;
  std::optional<double> max_grad_norm = 1.0;
  int64_t bucket_bytes = int64_t{25} << 20;
  bool bf16_autocast = false;        ///< forward under bf16 autocast (precision::Bf16Mixed)
  const EventBus* events = nullptr;  ///< receives BeforeOptimizer / AfterOptimizer
};

/// Global results of one step (identical on every rank).
struct StepResult {
  double loss = 0.0;       ///< sum(loss_sum) / sum(weight) over microbatches and dp ranks
  double weight = 0.0;     ///< sum(weight)
  double grad_norm = 0.0;  ///< before clipping
  double lr = 0.0;
};

/// A microbatch's loss, type-erased: the trainer wraps the user's task and batch type in it.
using MicrobatchLoss = std::function<LossOutput(const std::any& microbatch)>;

namespace detail {

class TrainStepCore {
 public:
  TrainStepCore(const DeviceMesh& mesh, std::shared_ptr<torch::nn::Module> model,
                MicrobatchLoss loss, TrainStepOptions options);
  ~TrainStepCore();
  TrainStepCore(const TrainStepCore&) = delete;
  TrainStepCore& operator=(const TrainStepCore&) = delete;
  TrainStepCore(TrainStepCore&&) = delete;
  TrainStepCore& operator=(TrainStepCore&&) = delete;

  /// One optimizer step over this rank's microbatches (collective over the dp group).
  StepResult run(const std::vector<std::any>& microbatches, int64_t step);
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& model() const;
  /// The data-parallel group gradients are reduced over.
  [[nodiscard]] const ProcessGroup& dp_group() const;
  /// The optimizer (AdamW) over the trained parameters (checkpoints read and restore its state).
  [[nodiscard]] torch::optim::Optimizer& optimizer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <class Plan>
constexpr void check_trainable_plan() {
  static_assert(std::is_same_v<typename Plan::pipeline, pipeline::NoPipeline>,
                "d9d::TrainStep: this plan's pipeline schedule is not supported by TrainStep yet. "
                "Fix: use d9d::pipeline::NoPipeline (the default) in the plan");
  static_assert(std::is_same_v<typename Plan::data_parallel, parallel::Replicate>,
                "d9d::TrainStep: only d9d::parallel::Replicate data parallelism is supported so "
                "far. Fix: use d9d::parallel::Replicate (the default) in the plan");
  static_assert(std::is_same_v<typename Plan::peft, peft::FullTune>,
                "d9d::TrainStep: only d9d::peft::FullTune is supported so far. Fix: use "
                "d9d::peft::FullTune (the default) in the plan");
  using Mesh = typename Plan::mesh;
  static_assert((Mesh::pp::is_dynamic || Mesh::pp::value == 1) &&
                    (Mesh::tp::is_dynamic || Mesh::tp::value == 1) &&
                    (Mesh::cp_replicate::is_dynamic || Mesh::cp_replicate::value == 1) &&
                    (Mesh::cp_shard::is_dynamic || Mesh::cp_shard::value == 1) &&
                    (Mesh::ep::is_dynamic || Mesh::ep::value == 1),
                "d9d::TrainStep: with d9d::parallel::Replicate only data-parallel degrees may "
                "exceed 1 (pp, tp, cp_replicate, cp_shard and ep must be 1). Fix: drop those "
                "degrees from the mesh");
}

template <class Plan>
constexpr bool uses_bf16_autocast() {
  if constexpr (std::is_same_v<typename Plan::precision, precision::Bf16Mixed>) {
    return true;
  } else {
    static_assert(std::is_same_v<typename Plan::precision, precision::Fp32>,
                  "d9d::TrainStep: supported precision policies are d9d::precision::Fp32 and "
                  "d9d::precision::Bf16Mixed");
    return false;
  }
}

/// Throws std::invalid_argument unless the resolved mesh uses only data-parallel degrees.
void check_replicate_mesh(const MeshShape& shape);

}  // namespace detail

/// One rank's optimizer step for `Plan` (see the file comment).
template <class Plan>
class TrainStep : public detail::TrainStepCore {
 public:
  TrainStep(const DeviceMesh& mesh, std::shared_ptr<torch::nn::Module> model, MicrobatchLoss loss,
            TrainStepOptions options)
      : detail::TrainStepCore(mesh, std::move(model), std::move(loss), with_plan(options, mesh)) {}

 private:
  static TrainStepOptions with_plan(TrainStepOptions options, const DeviceMesh& mesh) {
    detail::check_trainable_plan<Plan>();
    detail::check_replicate_mesh(mesh.shape());
    options.bf16_autocast = detail::uses_bf16_autocast<Plan>();
    return options;
  }
};

}  // namespace d9d
