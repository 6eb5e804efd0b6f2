// d9d/train/train_step.hpp — one rank's optimizer step, composed for a Plan.
//
//   d9d::TrainStep<MyPlan> step(mesh, model.ptr(), loss_of_microbatch, options);
//   d9d::StepResult r = step.run(microbatches, /*step=*/0);   // r.loss: global token mean
//
// TrainStep<Plan> checks the plan (every strategy's compile-time rules, the precision policy) and
// applies its strategies to the model through the parallelize layer
// (d9d/parallel/parallelize.hpp), then runs steps over what that layer recorded: zero the
// gradients; forward and backward every microbatch (sum losses, accumulate gradients) while the
// strategies' gradient paths reduce (Replicate: bucketed all-reduce in the last backward;
// FullyShard: per-unit gathers and reduce-scatters); then the gradients are divided by the global
// loss weight (so the loss is the token mean over every microbatch of every data-parallel rank),
// their norm is computed over the mesh and clipped, and AdamW updates each rank's parameters (the
// shards, under FullyShard). A step whose global loss or gradient norm is NaN or infinite on any
// rank skips the optimizer on every rank (StepResult::finite is false; the parameters and AdamW's
// state stay as they were). Non-template work lives in detail::TrainStepCore (compiled once,
// src/train/train_step.cpp). Trainer<Plan> composes the same step.
#pragma once

#include <any>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d {

/// How a step copies microbatches of a type-erased batch: CUDA graphs keep one captured
/// microbatch and copy the next ones' tensors into it. microbatch_copier<Batch>() makes it for a
/// batch tree (d9d/core/batch_tree.hpp).
struct MicrobatchCopier {
  /// A copy with its own tensors on `device` (the captured microbatch).
  std::function<std::any(const std::any& microbatch, c10::Device device)> clone;
  /// Copies `from`'s tensors into `into`'s: "" when done, else why the two differ in layout
  /// (sizes, dtypes, lengths, other values) and nothing was copied.
  std::function<std::string(std::any& into, const std::any& from)> copy;
};

template <class Batch>
MicrobatchCopier microbatch_copier() {
  return {.clone = [](const std::any& microbatch, c10::Device device) -> std::any {
            return detail::map_tree(std::any_cast<const Batch&>(microbatch), "",
                                    [device](const std::string& /*path*/, const at::Tensor& t) {
                                      return t.defined() ? t.to(device, /*non_blocking=*/false,
                                                                /*copy=*/true)
                                                         : t;
                                    });
          },
          .copy = [](std::any& into, const std::any& from) -> std::string {
            auto& dst = std::any_cast<Batch&>(into);
            const auto& src = std::any_cast<const Batch&>(from);
            auto difference = batch_layout_difference(dst, src);
            if (difference.empty()) {
              copy_batch_(dst, src, /*non_blocking=*/true);
            }
            return difference;
          }};
}

/// The knobs of a TrainStep (normally taken from a TrainerConfig).
struct TrainStepOptions {
  OptimizerConfig optimizer;
  std::vector<optim::Phase> lr_schedule;
  int64_t total_steps = 1;
  std::optional<double> max_grad_norm = 1.0;
  bool bf16_autocast = false;        ///< forward under bf16 autocast (set from the plan)
  bool stochastic_rounding = false;  ///< StochasticAdamW for bf16 parameters (from the plan)
  /// The dtype of AdamW's moments (from the plan); Undefined: the parameters' own.
  at::ScalarType optimizer_state = at::ScalarType::Undefined;
  uint64_t seed = 0;                 ///< the stochastic rounding's seed (the run's seed)
  const EventBus* events = nullptr;  ///< receives BeforeOptimizer / AfterOptimizer
  /// Pipelined steps: the step index (from 0) whose per-action timeline is gathered over the
  /// pipeline ranks and drawn under the plan into `timeline_path` (by world rank 0); -1: none.
  int64_t timeline_step = -1;
  std::string timeline_path = {};
  /// Called after each microbatch's loss with the loss output and the microbatch, outside any
  /// CUDA graph (the trainer updates the task's metrics here); empty: nothing.
  std::function<void(const LossOutput&, const std::any& microbatch)> after_microbatch = {};
  /// CUDA graphs (TrainerConfig::cuda_graphs, docs/train.md "CUDA graphs"): from step
  /// `graph_warmup_steps` on, the first microbatch's forward and backward are captured once and
  /// replayed for every microbatch of the same layout (`copier` copies its tensors into the
  /// captured one; others run eagerly). Needs a CUDA device, a single-rank gradient path
  /// (ParallelModel::graph_blocker) and `copier`; std::invalid_argument otherwise.
  bool cuda_graphs = false;
  int64_t graph_warmup_steps = 1;
  MicrobatchCopier copier = {};
};

/// Global results of one step (identical on every rank, but for the host timings).
struct StepResult {
  double loss = 0.0;       ///< sum(loss_sum) / sum(weight) over microbatches and dp ranks
  double weight = 0.0;     ///< sum(weight)
  double grad_norm = 0.0;  ///< before clipping
  double lr = 0.0;
  /// False when the loss or the gradient norm was NaN or infinite on some rank: then no rank's
  /// optimizer stepped (every rank agrees, through one all-reduce over the world).
  bool finite = true;
  /// Seconds the host spent issuing the microbatches' forward and backward (up to the gradient
  /// sync, before the step's first wait for the device): the launch cost that CUDA graphs cut.
  double issue_seconds = 0.0;
  /// Microbatches that replayed a CUDA graph (the rest ran eagerly).
  int replayed_microbatches = 0;
};

/// Training stopped on a NaN or infinite loss or gradient norm (config "numerics.on_nonfinite");
/// the message names the step, the values and the checkpoint kept.
class NumericalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A microbatch's loss, type-erased: the trainer wraps the user's task and batch type in it.
using MicrobatchLoss = std::function<LossOutput(const std::any& microbatch)>;

namespace detail {

class TrainStepCore {
 public:
  /// `model`: the parallelize layer's result for the step's model (its first module).
  TrainStepCore(std::unique_ptr<parallel::ParallelModel> model, MicrobatchLoss loss,
                TrainStepOptions options);
  ~TrainStepCore();
  TrainStepCore(const TrainStepCore&) = delete;
  TrainStepCore& operator=(const TrainStepCore&) = delete;
  TrainStepCore(TrainStepCore&&) = delete;
  TrainStepCore& operator=(TrainStepCore&&) = delete;

  /// One optimizer step over this rank's microbatches (collective over the mesh).
  StepResult run(const std::vector<std::any>& microbatches, int64_t step);
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& model() const;
  /// The parallelize layer's result: parameter records (what the optimizer updates, placements).
  [[nodiscard]] parallel::ParallelModel& parallel();
  /// The optimizer (AdamW) over the records' local tensors (checkpoints read and restore it).
  [[nodiscard]] torch::optim::Optimizer& optimizer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The run-time precision facts of a plan (its precision policy's members).
struct PrecisionOptions {
  at::ScalarType parameters = at::kFloat;
  bool bf16_autocast = false;
  bool stochastic_rounding = false;
  at::ScalarType optimizer_state = at::ScalarType::Undefined;  ///< Undefined: the parameters'

  /// Copies the facts into a step's options.
  void apply_to(TrainStepOptions& options) const {
    options.bf16_autocast = bf16_autocast;
    options.stochastic_rounding = stochastic_rounding;
    options.optimizer_state = optimizer_state;
  }
};

template <class Plan>
constexpr PrecisionOptions precision_options() {
  using P = typename Plan::precision;
  static_assert(
      requires {
        { P::parameters } -> std::convertible_to<precision::Dtype>;
        { P::compute } -> std::convertible_to<precision::Dtype>;
      },
      "d9d::TrainStep: the precision policy must state `parameters` and `compute` "
      "(d9d::precision::Dtype members), as d9d/precision/policies.hpp's policies do");
  static_assert(P::parameters != precision::Dtype::bfloat16 || P::compute == P::parameters,
                "d9d::TrainStep: bfloat16 parameters compute in bfloat16");
  static_assert(P::compute == P::parameters || P::compute == precision::Dtype::bfloat16,
                "d9d::TrainStep: compute runs in the parameters' dtype or in bfloat16 (autocast)");
  constexpr bool stochastic = [] {
    if constexpr (requires { P::stochastic_rounding; }) {
      return static_cast<bool>(P::stochastic_rounding);
    } else {
      return false;
    }
  }();
  static_assert(!stochastic || P::parameters == precision::Dtype::bfloat16,
                "d9d::TrainStep: stochastic rounding rounds updates to bfloat16 parameters. Fix: "
                "use d9d::precision::Bf16Params<StochasticRounding>");
  at::ScalarType state = at::ScalarType::Undefined;
  if constexpr (requires { P::optimizer_state; }) {
    state = parallel::detail::scalar_type_of(P::optimizer_state);
  }
  return {.parameters = parallel::detail::scalar_type_of(P::parameters),
          .bf16_autocast = P::compute != P::parameters,
          .stochastic_rounding = stochastic,
          .optimizer_state = state};
}

template <class S>
inline constexpr bool is_inference_schedule = false;
template <class M>
inline constexpr bool is_inference_schedule<pipeline::Inference<M>> = true;

/// Whether the plan runs a pipeline schedule (else the whole model is one stage per rank).
template <class Plan>
inline constexpr bool is_pipelined_v =
    !std::is_same_v<typename Plan::pipeline, pipeline::NoPipeline>;

/// Every compile-time rule of a trainable plan, in one place: the strategies' (parallelize
/// layer), the precision policy's and the pipeline slot's.
template <class Plan>
constexpr void check_step_plan() {
  parallel::check_plan<Plan>();
  (void)precision_options<Plan>();
  using S = typename Plan::pipeline;
  if constexpr (!is_pipelined_v<Plan>) {
    static_assert(
        !Plan::mesh::well_formed || Plan::mesh::pp::is_dynamic || Plan::mesh::pp::value == 1,
        "d9d::TrainStep: the plan's mesh has pp > 1 but no pipeline schedule. Fix: put "
        "a schedule in the plan (e.g. d9d::pipeline::OneFOneB<>), or drop d9d::pp from "
        "the mesh");
  } else {
    static_assert(pipeline::pipeline_schedule<S>,
                  "d9d::Trainer: the plan's pipeline slot holds no schedule. Fix: use one of "
                  "d9d/pipeline/schedules.hpp (e.g. d9d::pipeline::OneFOneB<>)");
    static_assert(!is_inference_schedule<S>,
                  "d9d::Trainer: d9d::pipeline::Inference runs forward only and cannot train. "
                  "Fix: choose a training schedule (GPipe, OneFOneB, ZeroBubbleH1, ...)");
  }
}

/// The run-time rules of the resolved mesh (std::invalid_argument naming the degree and the fix).
template <class Plan>
void check_step_mesh(const MeshShape& shape) {
  parallel::check_mesh<Plan>(shape);
  if constexpr (!is_pipelined_v<Plan>) {
    parallel::detail::require_degree_one("pp", shape.pp, "d9d::pipeline::NoPipeline",
                                         "set \"mesh.pp\" to 1 or put a schedule in the plan");
  }
}

}  // namespace detail

/// One rank's optimizer step for `Plan` (see the file comment). The model must be the whole model
/// (a pipeline plan runs through Trainer<Plan>).
template <class Plan>
class TrainStep : public detail::TrainStepCore {
 public:
  TrainStep(const DeviceMesh& mesh, std::shared_ptr<torch::nn::Module> model, MicrobatchLoss loss,
            TrainStepOptions options, parallel::ParallelizeOptions parallel = {})
      : detail::TrainStepCore(make(mesh, std::move(model), std::move(parallel)), std::move(loss),
                              with_plan(options)) {}

 private:
  static std::unique_ptr<parallel::ParallelModel> make(const DeviceMesh& mesh,
                                                       std::shared_ptr<torch::nn::Module> model,
                                                       parallel::ParallelizeOptions parallel) {
    detail::check_step_plan<Plan>();
    static_assert(!detail::is_pipelined_v<Plan>,
                  "d9d::TrainStep: runs the whole model on each rank; pipeline plans run through "
                  "d9d::Trainer<Plan>");
    detail::check_step_mesh<Plan>(mesh.shape());
    return parallel::parallelize<Plan>(mesh, {std::move(model)}, std::move(parallel));
  }
  static TrainStepOptions with_plan(TrainStepOptions options) {
    detail::precision_options<Plan>().apply_to(options);
    return options;
  }
};

}  // namespace d9d
