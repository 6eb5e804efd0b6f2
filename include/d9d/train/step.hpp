// d9d/train/step.hpp — the training step as a component of the Plan: what every step offers the
// loop, and the knobs and results they share.
//
//   using Step = d9d::step_component<typename MyPlan::pipeline>;   // chosen by the pipeline slot
//   std::unique_ptr<d9d::detail::StepCore> step = ...;              // built by Trainer<Plan>
//   d9d::StepResult r = step->run(microbatches, /*step=*/0);        // r.loss: global token mean
//
// The pipeline slot's policy chooses the step: d9d::pipeline::NoPipeline gives the whole-model
// step (every rank runs the whole model over its microbatches: d9d/train/train_step.hpp), a
// schedule gives the pipelined step (this rank's stages run the schedule's program:
// d9d/train/pipeline_step.hpp). Each is the specialisation step_component<Policy>, which states
// the step's compile-time rules (check<Plan>()), its start-up rules for the mesh (check_mesh), how
// it builds this rank's modules from the model provider (build), and how it wraps the user's task
// into a training step (train_step) or a forward step (forward_step, for d9d::Inference). What
// runs is behind one interface compiled once, detail::StepCore: run a step, its modules, its
// export, its description. d9d::compose<Plan> (d9d/train/compose.hpp) is the one place a Plan
// becomes a rank's composed model; Trainer<Plan> and Inference<Plan> each hold one step.
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
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d {

/// How a step copies microbatches of a type-erased batch: CUDA graphs keep one captured
/// microbatch and copy the next ones' tensors into it; the pipelined step moves each step's
/// microbatches to the device before its program runs. microbatch_copier<Batch>() makes it for a
/// batch tree (d9d/core/batch_tree.hpp).
struct MicrobatchCopier {
  /// A copy with its own tensors on `device` (the captured microbatch). Host tensors reach a
  /// CUDA device through pinned memory on the current stream, without waiting for the device.
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
                                      if (!t.defined()) {
                                        return t;
                                      }
                                      if (device.is_cuda() && t.device().is_cpu()) {
                                        return t.pin_memory().to(device, /*non_blocking=*/true);
                                      }
                                      return t.to(device, /*non_blocking=*/false, /*copy=*/true);
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

/// The knobs of a step (normally taken from a TrainerConfig).
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

/// What an export writes: the whole model as a Hugging Face checkpoint (model.safetensors,
/// config.json) and, with LoRA adapters, the adapter in peft's format.
struct ExportRequest {
  std::string dir;          ///< the model's directory
  std::string adapter_dir;  ///< the adapter's (with LoRA adapters)
  at::ScalarType dtype = at::kFloat;
  std::string hf_config_json;  ///< config.json's text ("" : none)
  /// Model names -> checkpoint names (the provider's hf_export_mapper); empty: names as they are.
  std::function<state::Mapper(const std::vector<std::string>&)> mapper;
};

/// What an export wrote (paths set on the main rank only).
struct ExportResult {
  std::string model_dir;
  std::string adapter_dir;  ///< empty without LoRA adapters
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

/// A Plan composed on this rank (d9d::compose, d9d/train/compose.hpp): the mesh, what the
/// strategies contribute to the data and the loss, the step's microbatch count, this rank's
/// modules as the step component built them, and the parallelize layer's result for them.
template <class Modules>
struct Composition {
  std::shared_ptr<const DeviceMesh> mesh;
  parallel::StepContributions contributions;
  int64_t microbatches = 1;
  Modules modules;
  std::unique_ptr<parallel::ParallelModel> parallel;
};

/// What a step component's build gets from d9d::compose.
struct StepBuildInputs {
  const DistributedContext& context;
  const DeviceMesh& mesh;
  const TrainerConfig& config;
  int64_t microbatches = 1;
};

/// A forward-only step (d9d::Inference): this rank's rows of one step's microbatches, in sample
/// order; undefined on a rank without outputs (a pipeline rank that does not hold the last stage).
struct ForwardStep {
  std::unique_ptr<parallel::ParallelModel> parallel;
  std::function<at::Tensor(const std::vector<std::any>& microbatches)> run;
  /// The model is this rank's pipeline stages (other ranks hold the others).
  bool stages_elsewhere = false;
};

/// The component that implements a pipeline slot's policy as a step (see the file comment):
/// train_step.hpp specialises it for d9d::pipeline::NoPipeline, pipeline_step.hpp for the
/// schedules. The primary template is a pipeline slot that holds no schedule.
template <class Schedule>
struct step_component {
  template <class Plan>
  static constexpr void check() {
    static_assert(::d9d::detail::plan_dependent_false<Schedule>,
                  "d9d::Trainer: the plan's pipeline slot holds no schedule. Fix: use one of "
                  "d9d/pipeline/schedules.hpp (e.g. d9d::pipeline::OneFOneB<>)");
  }
  static void check_mesh(const MeshShape& /*shape*/) {}
};

namespace detail {

/// The precision policy's facts, checked (static_asserts naming the fix).
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
    state = precision::scalar_type(P::optimizer_state);
  }
  return {.parameters = precision::scalar_type(P::parameters),
          .bf16_autocast = P::compute != P::parameters,
          .stochastic_rounding = stochastic,
          .optimizer_state = state};
}

/// One rank's composed step behind one interface, so the loops are compiled once (the step
/// concept: step_component<...>::train_step builds one).
class StepCore {
 public:
  StepCore() = default;
  virtual ~StepCore() = default;
  StepCore(const StepCore&) = delete;
  StepCore& operator=(const StepCore&) = delete;
  StepCore(StepCore&&) = delete;
  StepCore& operator=(StepCore&&) = delete;

  /// One optimizer step over this rank's microbatches (collective over the mesh).
  virtual StepResult run(const std::vector<std::any>& microbatches, int64_t step) = 0;
  /// What this rank trains: the whole model, or its pipeline stages in stage order.
  [[nodiscard]] virtual std::vector<std::shared_ptr<torch::nn::Module>> modules() const = 0;
  /// The whole model when this rank holds it; null when it holds pipeline stages.
  [[nodiscard]] virtual std::shared_ptr<torch::nn::Module> whole_model() const = 0;
  /// The parallelize layer's result: the parameter records the optimizer, clipping and
  /// checkpoints use (under FullyShard their local tensors are this rank's shards).
  [[nodiscard]] virtual parallel::ParallelModel& parallel() = 0;
  /// The optimizer (AdamW) over the records' local tensors.
  [[nodiscard]] virtual torch::optim::Optimizer& optimizer() = 0;
  /// Writes the whole model (collective over every rank).
  virtual ExportResult export_model(const ExportRequest& request) = 0;
  /// For the start-up line: ", pipeline of 4 stages (...)", or "" for the whole model.
  [[nodiscard]] virtual std::string describe() const = 0;
};

/// Calls `f` with the microbatch (a Batch in a std::any) as the model sees it: sharded by the
/// strategies' contributions (each tensor of the batch tree by path), or itself when there are
/// none.
template <class Batch, class F>
decltype(auto) with_sharded(const parallel::StepContributions& contributions,
                            const std::any& microbatch, F&& f) {
  const auto& batch = std::any_cast<const Batch&>(microbatch);
  if (contributions.microbatch.empty()) {
    return std::forward<F>(f)(batch);
  }
  const Batch sharded = map_tree(batch, "", [&](const std::string& path, const at::Tensor& t) {
    return t.defined() ? contributions.shard(path, t) : t;
  });
  return std::forward<F>(f)(sharded);
}

template <class S>
inline constexpr bool is_inference_schedule = false;
template <class M>
inline constexpr bool is_inference_schedule<pipeline::Inference<M>> = true;

}  // namespace detail

}  // namespace d9d
