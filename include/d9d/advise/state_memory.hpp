// d9d/advise/state_memory.hpp — the bytes each rank keeps between steps under a Plan, known before
// launch: its parameters, their gradients and AdamW's two moments. The first part of the Plan
// advisor (docs/advise.md); activations, gathered units and communication buffers come later.
//
//   const auto parameters = d9d::advise::qwen3_parameters(config);           // names and shapes
//   // under a pipeline: d9d::advise::qwen3_rank_parameters<MyPlan>(config, shape, pp_rank, m, T)
//   const auto rules = d9d::advise::state_rules<MyPlan>(d9d::MeshShape{.dp_shard = 8});
//   const d9d::advise::StateBytes bytes = d9d::advise::state_bytes(parameters, rules, 0);
//   bytes.parameters; bytes.gradients; bytes.optimizer; bytes.total();      // on dp_shard rank 0
//
// The rules are the library's own (tests/advise checks them against what Trainer<Plan> allocates):
// every trained parameter is held in the precision's parameter dtype, whole under Replicate, and
// under FullyShard split along its first dimension over dp_shard x cp_shard by torch.chunk's rule
// (ceil(n / ranks) rows per rank, the last ranks fewer or none); its gradient is a tensor of the
// same shape and dtype; AdamW keeps exp_avg and exp_avg_sq of that shape, in the parameter dtype
// (d9d::optim::FusedAdamW, torch's AdamW) or in the precision's optimizer_state dtype under
// stochastic rounding (d9d::optim::StochasticAdamW).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/core/ScalarType.h>

#include <d9d/core/mesh_shape.hpp>
#include <d9d/peft/stack.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/plan/defaults.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/precision/scalar_type.hpp>

namespace d9d::model {
struct Qwen3Config;
struct Qwen3MoeConfig;
}  // namespace d9d::model

namespace d9d::advise {

/// One parameter as the model registers it.
struct ParameterShape {
  std::string name;            ///< as named_parameters() names it
  std::vector<int64_t> sizes;  ///< its whole shape
  bool trained = true;         ///< false: frozen (no gradient, no optimizer state)
  /// The dimension tensor parallelism splits (Megatron's layout, src/parallel/tensor_parallel.cpp:
  /// 0 for q/k/v, gate/up, the embedding and the head; 1 for o and down), -1: replicated.
  int tensor_split_dim = -1;
  /// A MoE layer's routed experts ([experts, ...]): ExpertParallel splits dim 0 over ep_shard and
  /// keeps them in the expert domain (src/parallel/expert_parallel.cpp).
  bool expert = false;
  /// A LoRA adapter's lora_A (apply_peft): the adapter's scale, alpha / rank; 0 otherwise.
  double lora_scale = 0;

  [[nodiscard]] int64_t numel() const;
};

/// d9d::model::Qwen3ForCausalLM's parameters for `config`, in registration order.
[[nodiscard]] std::vector<ParameterShape> qwen3_parameters(const model::Qwen3Config& config);

/// The parameters of d9d::model::Qwen3Stage `stage` of `stages`, in registration order: decoder
/// layers by d9d::model::distribute_layers weighed by pipeline_virtual_layers at
/// `sequence_length` (as Qwen3Provider builds them), the embedding on the first stage, the final
/// norm and the head on the last, and under a tied head a copy of the embedding on a last stage
/// that is not the first.
[[nodiscard]] std::vector<ParameterShape> qwen3_stage_parameters(const model::Qwen3Config& config,
                                                                 int stage, int stages,
                                                                 int64_t sequence_length);

/// The parameters pipeline rank `pp_rank` holds under `program` (d9d/pipeline/program.hpp): its
/// stages' (qwen3_stage_parameters for each stage the program places on it, in stage order).
[[nodiscard]] std::vector<ParameterShape> qwen3_rank_parameters(const model::Qwen3Config& config,
                                                                const pipeline::Program& program,
                                                                int pp_rank,
                                                                int64_t sequence_length);

/// d9d::model::Qwen3MoeForCausalLM's parameters (and its stages', and a pipeline rank's, as for
/// the dense model): each MoE layer's router ("mlp.gate.weight", [experts, hidden]), its routed
/// experts ("mlp.experts.{gate,up,down}_proj", marked `expert`) and, when the config has one, its
/// shared expert and that expert's gate; the layers of mlp_only_layers (or off the sparse step)
/// keep the dense MLP. No tensor-parallel split dimensions on the MoE block's parameters (tp runs a
/// MoE layer on its tokens' share with whole experts).
[[nodiscard]] std::vector<ParameterShape> qwen3_parameters(const model::Qwen3MoeConfig& config);
[[nodiscard]] std::vector<ParameterShape> qwen3_stage_parameters(
    const model::Qwen3MoeConfig& config, int stage, int stages, int64_t sequence_length);
[[nodiscard]] std::vector<ParameterShape> qwen3_rank_parameters(const model::Qwen3MoeConfig& config,
                                                                const pipeline::Program& program,
                                                                int pp_rank,
                                                                int64_t sequence_length);

/// A dense Qwen3's `parameters` (any of the lists above) under the peft stack `spec`
/// (d9d::peft::stack_spec<Policy>(), d9d/peft/lora.hpp's rules): each linear layer a Lora method
/// targets (q/k/v/o, gate/up/down, lm_head by name; no patterns: all but lm_head) is frozen and
/// followed by its adapter, "<layer>.lora_A.weight" [rank, in] and "<layer>.lora_B.weight"
/// [out, rank], trained; a parameter that a Freeze pattern matches is frozen, one that a Train
/// pattern matches trains, and the rest train when spec.rest_trains. std::invalid_argument for a
/// parameter two methods claim (the trainer refuses that stack at start-up). Patterns that match
/// nothing are not checked here (under a pipeline a pattern may match on another rank's stages).
[[nodiscard]] std::vector<ParameterShape> apply_peft(const std::vector<ParameterShape>& parameters,
                                                     const peft::StackSpec& spec);

/// The parameters pipeline rank `pp_rank` holds under `Plan`: those of the program its schedule
/// builds for `shape.pp` ranks and `microbatches` (placement does not depend on the count, but a
/// schedule may refuse one), or the whole model's without a pipeline; under a PEFT policy the
/// dense model's with its adapters and frozen parameters (apply_peft; a Qwen3-MoE's:
/// std::invalid_argument, not predicted yet). `Config` is model::Qwen3Config or
/// model::Qwen3MoeConfig.
template <class Plan, class Config>
std::vector<ParameterShape> qwen3_rank_parameters(const Config& config, const MeshShape& shape,
                                                  int pp_rank, int microbatches,
                                                  int64_t sequence_length) {
  using Schedule = typename Plan::pipeline;
  std::vector<ParameterShape> out;
  if constexpr (std::is_same_v<Schedule, pipeline::NoPipeline>) {
    (void)shape;
    (void)pp_rank;
    (void)microbatches;
    (void)sequence_length;
    out = qwen3_parameters(config);
  } else {
    out = qwen3_rank_parameters(config, Schedule::build(shape.pp, microbatches), pp_rank,
                                sequence_length);
  }
  if constexpr (!std::is_same_v<typename Plan::peft, peft::FullTune>) {
    if constexpr (!std::is_same_v<Config, model::Qwen3Config>) {
      throw std::invalid_argument(
          "d9d::advise::qwen3_rank_parameters: a PEFT policy on a Qwen3-MoE is not predicted "
          "yet (predicted: the dense Qwen3's)");
    }
    out = apply_peft(out, peft::stack_spec<typename Plan::peft>());
  }
  return out;
}

/// How a Plan stores each trained parameter's state.
struct StateRules {
  at::ScalarType parameters = at::kFloat;  ///< the parameter's dtype (the master copy)
  at::ScalarType gradients = at::kFloat;   ///< its .grad's dtype
  at::ScalarType optimizer = at::kFloat;   ///< AdamW's exp_avg and exp_avg_sq
  /// Ranks each parameter's rows are split over (FullyShard: dp_shard x cp_shard); 1: whole.
  int shard_ranks = 1;
  /// Ranks tensor parallelism splits each parameter's tensor_split_dim over (tp); 1: none.
  int tensor_ranks = 1;
  /// ExpertParallel: the `expert` parameters live in the expert domain, dim 0 split over
  /// `expert_ranks` (ep_shard) and their rows then over `expert_shard_ranks` (FullyShard with
  /// ep_replicate > 1; 1: whole), by the expert-domain coordinate state_bytes takes.
  bool expert_parallel = false;
  int expert_ranks = 1;
  int expert_shard_ranks = 1;
};

/// The expert domain's ep_replicate for `shape` (d9d::DeviceMesh's rule: a stage's ranks over
/// the HSDP replicas that hold whole expert groups, over ep).
[[nodiscard]] int expert_replicate_ranks(const MeshShape& shape);

/// What one rank keeps between steps, in bytes.
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;

  [[nodiscard]] int64_t total() const { return parameters + gradients + optimizer; }
};

/// The rows of an n-row parameter that rank `rank` of `ranks` holds (torch.chunk's rule).
[[nodiscard]] int64_t shard_rows(int64_t rows, int ranks, int rank);

/// The state that rank `shard_rank` (its coordinate in the shard group, 0 when unsharded) keeps:
/// each parameter split first by tensor parallelism (evenly; std::invalid_argument when a split
/// dimension does not divide), then its rows by the shard rule. Under expert parallelism the
/// experts split their dim 0 over rules.expert_ranks (evenly) and their rows over
/// rules.expert_shard_ranks by `expert_shard_rank` (the rank's ep_replicate coordinate).
/// std::invalid_argument for a rank outside its group.
[[nodiscard]] StateBytes state_bytes(const std::vector<ParameterShape>& parameters,
                                     const StateRules& rules, int shard_rank,
                                     int expert_shard_rank = 0);

/// What FullyShard holds gathered at the peak of a step, in bytes.
struct GatheredBytes {
  /// Units gathered into their storage: ParallelModel::peak_extra_bytes.
  int64_t units = 0;
  /// The prefetched unit's all-gather output, in flight beside them (not in peak_extra_bytes).
  int64_t in_flight = 0;

  [[nodiscard]] int64_t total() const { return units + in_flight; }
};

/// What FullyShard holds gathered at the peak of a step for a whole model's `parameters` (no
/// pipeline; each split by tensor parallelism as `rules` says; under expert parallelism without
/// ep_replicate the experts, which FullyShard leaves whole, are not in its units, and with
/// ep_replicate > 1 std::invalid_argument: their own units are not predicted yet). Its units are
/// the decoder layers
/// ("model.layers.N.") and one unit of the rest (embedding, final norm, head), gathered whole in
/// `gathered` (the precision's compute dtype). With `reshard_after_forward` (Reshard::after_forward
/// or all_but_last) the rest's unit and the largest layer, and with `prefetch` > 0 the next
/// layer's all-gather in flight; otherwise every unit.
[[nodiscard]] GatheredBytes fully_shard_gathered_bytes(
    const std::vector<ParameterShape>& parameters, const StateRules& rules, at::ScalarType gathered,
    bool reshard_after_forward, int prefetch = 1);

/// The dtypes precision policy `P` stores a parameter's state in (unsplit): the parameter dtype
/// for the parameters, their gradients and AdamW's moments, or the policy's optimizer_state for
/// the moments under stochastic rounding.
template <class P>
StateRules precision_rules() {
  StateRules rules;
  rules.parameters = precision::scalar_type(P::parameters);
  rules.gradients = rules.parameters;
  rules.optimizer = rules.parameters;
  if constexpr (requires { P::stochastic_rounding; }) {
    if constexpr (P::stochastic_rounding) {
      rules.optimizer = precision::scalar_type(P::optimizer_state);
    }
  }
  return rules;
}

/// The rules of `Plan` on a mesh of `shape` (resolved degrees). Predicted so far: Replicate and
/// FullyShard, tensor and context parallelism (context parallelism splits no parameter; FullyShard
/// then shards over dp_shard x cp_shard), expert parallelism (the experts over ep_shard, and under
/// FullyShard over ep_replicate), every pipeline schedule (with qwen3_rank_parameters),
/// every precision (Float8 keeps its base policy's master weights, gradients and moments: its
/// float8 copies live during the step only), FullTune, and the PEFT policies (LoRA, Freeze, Train
/// and their stacks, with qwen3_rank_parameters: the adapters and the frozen base in the
/// parameter dtype, as the parallelize layer casts the model before it adds the adapters) without
/// FullyShard, tensor or expert parallelism; other Plans get std::invalid_argument naming what is
/// not predicted yet.
template <class Plan>
StateRules state_rules(const MeshShape& shape) {
  using P = typename Plan::precision;
  const auto not_yet = [](const char* what) {
    return std::invalid_argument(std::string("d9d::advise::state_rules: ") + what +
                                 " is not predicted yet (predicted: Replicate or FullyShard, "
                                 "tensor, context and expert parallelism, pipelines, FullTune; "
                                 "PEFT policies without FullyShard, tp or ep)");
  };
  if constexpr (!std::is_same_v<typename Plan::peft, peft::FullTune>) {
    constexpr bool shards_parameters = [] {
      if constexpr (requires { Plan::data_parallel::shards_parameters; }) {
        return Plan::data_parallel::shards_parameters;
      } else {
        return false;
      }
    }();
    if (shards_parameters) {
      throw not_yet("a PEFT policy under FullyShard (the frozen parameters' shards)");
    }
    if (!std::is_same_v<typename Plan::tensor_parallel, parallel::NoTensorParallel> ||
        !std::is_same_v<typename Plan::expert_parallel, parallel::NoExpertParallel>) {
      throw not_yet("a PEFT policy under tensor or expert parallelism");
    }
  }
  StateRules rules = precision_rules<P>();  // a Float8 policy's are its base's
  if constexpr (!std::is_same_v<typename Plan::tensor_parallel, parallel::NoTensorParallel>) {
    rules.tensor_ranks = shape.tp;
  }
  constexpr bool shards = [] {
    if constexpr (requires { Plan::data_parallel::shards_parameters; }) {
      return Plan::data_parallel::shards_parameters;
    } else {
      return false;
    }
  }();
  if constexpr (shards) {
    rules.shard_ranks = shape.dp_shard * shape.cp_shard;
  }
  if constexpr (!std::is_same_v<typename Plan::expert_parallel, parallel::NoExpertParallel>) {
    rules.expert_parallel = true;
    rules.expert_ranks = shape.ep;
    rules.expert_shard_ranks = shards ? expert_replicate_ranks(shape) : 1;
  }
  return rules;
}

}  // namespace d9d::advise
