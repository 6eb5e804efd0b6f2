// d9d/advise/preflight.hpp — the advisor's prediction for the Plan a run is about to train, at
// start-up, from the trainer config's "advise" section (docs/advise.md, "Pre-flight"):
//
//   "advise": {"enabled": true, "memory_gib": 139, "profile": "docs/profiles/h200-1gpu.json"}
//
//   if (const auto p = d9d::advise::preflight<MyPlan>(config, ctx.mesh().shape())) {
//     for (const auto& line : p->lines) ctx.log(line);   // or std::puts on the main rank
//     if (!p->fits) ...;                                   // the first line is a warning
//   }
//
// It predicts the fullest rank's state (parameters, gradients, AdamW's moments) and activations
// (d9d/advise/state_memory.hpp, activation_memory.hpp) and, with "profile", the step time
// (step_time.hpp); with "memory_gib" it warns when the prediction does not fit and names the
// fastest Plan shape predicted to fit the same ranks (rank_plans). A Qwen3-MoE model (the model
// section's "model_type": "qwen3_moe") is predicted without a pipeline, tensor or context
// parallelism and recompute, its experts over the Plan's ep ranks at their balanced load. What it
// cannot predict (LoRA, fp64, Float8's activations and step, activations under tensor parallelism
// under a pipeline, context parallelism or partial recompute under a pipeline, a MoE model under
// the strategies just named) it says, instead of guessing. The Trainer itself does not call it: the
// core is model-agnostic and the advisor models dense Qwen3 (docs/design/0024).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/advise/candidates.hpp>
#include <d9d/advise/state_memory.hpp>
#include <d9d/advise/step_time.hpp>
#include <d9d/core/mesh_shape.hpp>
#include <d9d/peft/stack.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/plan/defaults.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/recompute/policies.hpp>
#include <d9d/train/config.hpp>

namespace d9d::advise {

/// The config's "advise" section. Keys: "enabled" (default true when the section is present),
/// "memory_gib" (a rank's memory; 0 or absent: no fit check), "profile" (a machine profile's
/// path; absent: no step time). Unknown keys and wrong types are std::invalid_argument.
struct PreflightSettings {
  bool enabled = false;
  double memory_gib = 0;
  std::string profile{};
};

[[nodiscard]] PreflightSettings preflight_settings(const TrainerConfig& config);

/// What the pre-flight predicted.
struct Preflight {
  std::string plan{};                         ///< Candidate::describe()
  int64_t state_bytes = 0;                    ///< the fullest rank's
  std::optional<int64_t> activation_bytes{};  ///< where predicted
  /// The fullest rank's peak during a step (peak_step_bytes / peak_rank_step_bytes), where the
  /// activations are predicted.
  std::optional<int64_t> peak_bytes{};
  std::optional<StepTime> time{};    ///< with a profile, where predicted
  bool fits = true;                  ///< the peak (or the state) within memory_gib; true without it
  std::vector<std::string> lines{};  ///< what to log, the warning first
};

/// The runtime facts of a Plan the pre-flight reads (preflight<Plan> fills them from its slots).
struct PreflightPlan {
  Candidate candidate{};              ///< microbatches: per data-parallel rank and step
  pipeline::Program program{};        ///< the Plan's schedule under a pipeline
  std::optional<StateRules> rules{};  ///< none: the state is not predicted (why below)
  std::string not_predicted{};        ///< what the Plan has that is not predicted
  std::optional<Compute> compute{};   ///< none: fp64
  Recompute recompute{};              ///< the Plan's recompute policy
  bool sequence_parallel = false;     ///< TensorParallel<SequenceParallel::on>
  bool reduce_bf16 = false;           ///< Bf16MixedBf16Reduce
  bool float8 = false;                ///< a Float8 precision (its state is its base's)
  /// The Plan's peft policy (d9d::peft::stack_spec): with a method other than FullTune the state
  /// counts its adapters and frozen parameters (apply_peft); its activations and step time are
  /// predicted without a pipeline or recompute (qwen3_peft_activation_delta, StepOptions::peft).
  peft::StackSpec peft{.methods = {{.kind = peft::MethodKind::full_tune}}};

  /// Whether the peft policy is anything but FullTune.
  [[nodiscard]] bool fine_tunes() const;
};

/// The prediction for a Plan given by its runtime facts: its figures, and its lines with the step
/// on `machine` (null: none) and the warning when above `memory_gib` (0: no check). What
/// preflight and d9d::bench::compare print.
[[nodiscard]] Preflight predict_plan(const TrainerConfig& config, const PreflightPlan& plan,
                                     const MachineProfile* machine, double memory_gib);

/// The pre-flight of a Plan given by its runtime facts; std::nullopt when not enabled.
[[nodiscard]] std::optional<Preflight> preflight(const TrainerConfig& config,
                                                 const PreflightPlan& plan);

/// The runtime facts of `Plan` on a mesh of `shape`, read from its slots.
template <class Plan>
PreflightPlan preflight_plan(const TrainerConfig& config, const MeshShape& shape) {
  using P = typename Plan::precision;
  using R = typename Plan::activation_checkpointing;
  using Schedule = typename Plan::pipeline;
  constexpr bool shards = [] {
    if constexpr (requires { Plan::data_parallel::shards_parameters; }) {
      return Plan::data_parallel::shards_parameters;
    } else {
      return false;
    }
  }();
  PreflightPlan plan;
  auto& c = plan.candidate;
  c.fully_shard = shards;
  c.dp_replicate = shards ? shape.dp_replicate : shape.dp_replicate * shape.dp_shard;
  c.dp_shard = shards ? shape.dp_shard : 1;
  c.cp = shape.cp_shard;
  c.tp = std::is_same_v<typename Plan::tensor_parallel, parallel::NoTensorParallel> ? 1 : shape.tp;
  if constexpr (requires { Plan::tensor_parallel::sequence_parallel; }) {
    plan.sequence_parallel = Plan::tensor_parallel::sequence_parallel;
  }
  c.pp = shape.pp;
  c.microbatches = static_cast<int>(config.microbatches_per_step(c.dp_replicate * c.dp_shard));
  if constexpr (!std::is_same_v<Schedule, pipeline::NoPipeline>) {
    c.schedule = "the Plan's";
    plan.program = Schedule::build(shape.pp, c.microbatches);
  }
  try {
    plan.rules = state_rules<Plan>(shape);
  } catch (const std::invalid_argument& e) {
    plan.not_predicted = e.what();
  }
  if constexpr (P::parameters == precision::Dtype::bfloat16) {
    plan.compute = Compute::bf16_parameters;
  } else if constexpr (P::compute == precision::Dtype::bfloat16) {
    plan.compute = shards ? Compute::bf16_parameters : Compute::bf16_autocast;
    plan.reduce_bf16 = P::reduce == precision::Dtype::bfloat16;
  } else if constexpr (P::compute == precision::Dtype::float32) {
    plan.compute = Compute::float32;
  }
  plan.float8 = precision::has_float8<P>;
  plan.peft = peft::stack_spec<typename Plan::peft>();
  plan.recompute = {.every_nth = R::every_nth,
                    .attention_only = R::scope == recompute::Scope::attention};
  return plan;
}

/// The pre-flight of `Plan` on a mesh of `shape` (see the file comment); std::nullopt when the
/// config does not enable it.
template <class Plan>
std::optional<Preflight> preflight(const TrainerConfig& config, const MeshShape& shape) {
  if (!preflight_settings(config).enabled) {
    return std::nullopt;
  }
  return preflight(config, preflight_plan<Plan>(config, shape));
}

}  // namespace d9d::advise
