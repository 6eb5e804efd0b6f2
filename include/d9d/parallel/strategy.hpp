// d9d/parallel/strategy.hpp — what a strategy is: the component d9d::parallel::strategy<Policy>
// that implements a plan policy of a horizontal slot, its concept, and the order of the slots.
//
//   template <> struct d9d::parallel::strategy<MyPolicy> {
//     using strategy_concept = d9d::parallel::strategy_tag;                        // the opt-in
//     template <class Plan> static constexpr void check() {}                      // static rules
//     static void check_mesh(const d9d::MeshShape& shape) {}                       // start-up
//     rules template <class Plan> static void apply(d9d::parallel::ParallelModel& m) {}  // the
//     model template <class Plan> static void contribute(d9d::parallel::StepContributions& c) {} //
//     opt.
//   };
//
// Models d9d::parallel::parallel_strategy<S, Plan>. A strategy has four required parts: the opt-in
// tag, check<Plan>() (compile-time rules: static_asserts naming the fix), check_mesh(shape) (the
// same rules for d9d::dynamic degrees at start-up: std::invalid_argument naming the key), and
// apply<Plan>(model) (what it does to the modules and to the parameter records, and the
// GradientSync it adds). Optionally contribute<Plan>(contributions): what it does to the data and
// the loss — over which mesh dims the global batch's samples are split, over which the loss sums
// and token counts are summed, and how each microbatch is sharded before the model sees it.
// Strategies read facts of the whole Plan (its pipeline slot, its precision) from the Plan they
// are given, never from run-time flags. d9d/parallel/parallelize.hpp holds the library's
// strategies and applies them in strategy_order.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/mesh_shape.hpp>

namespace d9d {
class DeviceMesh;
class ProcessGroup;
}  // namespace d9d

namespace d9d::parallel {

class ParallelModel;

/// The opt-in tag of d9d::parallel::parallel_strategy: `using strategy_concept =
/// d9d::parallel::strategy_tag;` in a strategy<Policy> specialisation.
struct strategy_tag {};

/// A microbatch's tensor (its path in the batch tree, e.g. "tokens") -> this rank's part of it.
using MicrobatchSharding = std::function<at::Tensor(const std::string& path, const at::Tensor&)>;

/// What the strategies of a Plan do to each step's data and loss, besides parameters and
/// gradients. Dims are of MeshDomain::batch (pp, dp, cp, tp).
struct StepContributions {
  /// The dims over which the global batch's samples are split: each coordinate reads its share
  /// (data parallelism: {"dp"}). Other ranks with the same coordinates read the same samples.
  std::vector<std::string> sample_dims;
  /// The dims over which each step's loss sums and loss weights (token counts) are summed, besides
  /// the step's own (a pipeline sums over pp): where ranks hold different samples or different
  /// parts of them (data parallelism: {"dp"}; context parallelism adds "cp").
  std::vector<std::string> loss_dims;
  /// The dims over which each sequence is split (context parallelism: {"cp"}): the ranks along
  /// them read the same samples and each computes on its part of every sequence, which the model
  /// cuts (d9d::model::ContextParallelModel). A pipeline step hands the share to the task's loss of
  /// the last stage's output (d9d::SequencePart). Empty: every rank sees whole sequences.
  std::vector<std::string> sequence_dims;
  /// Applied to each tensor of every microbatch before the model sees it, in strategy order.
  /// Empty: microbatches go in whole.
  std::vector<MicrobatchSharding> microbatch;

  /// This rank's share of the samples: its row-major coordinate over sample_dims and their count.
  struct Share {
    int index = 0;
    int count = 1;
  };
  [[nodiscard]] Share samples(const DeviceMesh& mesh) const;
  /// This rank's part of each sequence: its row-major coordinate over sequence_dims and their
  /// count ({0, 1} when no strategy splits sequences).
  [[nodiscard]] Share sequence_part(const DeviceMesh& mesh) const;
  /// One process group per loss dim (in order), for the step's totals.
  [[nodiscard]] std::vector<ProcessGroup> loss_groups(const DeviceMesh& mesh) const;
  /// `tensor` after every microbatch sharding (the tensor itself when there is none).
  [[nodiscard]] at::Tensor shard(const std::string& path, const at::Tensor& tensor) const;
};

/// The component that implements a policy (specialised in d9d/parallel/parallelize.hpp and by
/// users for their own policies).
template <class Policy>
struct strategy;

// ---- the concept, part by part (so a compiler error names the part that is missing) -----------

template <class S>
concept strategy_opts_in = requires {
  typename S::strategy_concept;
}
&&std::derived_from<typename S::strategy_concept, strategy_tag>;

template <class S, class Plan>
concept strategy_checks_plan = requires {
  S::template check<Plan>();
};

template <class S>
concept strategy_checks_mesh = requires(const MeshShape& shape) {
  S::check_mesh(shape);
};

template <class S, class Plan>
concept strategy_applies = requires(ParallelModel& model) {
  S::template apply<Plan>(model);
};

/// The optional part: contribute<Plan>(StepContributions&).
template <class S, class Plan>
concept strategy_contributes = requires(StepContributions& contributions) {
  S::template contribute<Plan>(contributions);
};

/// A strategy for `Plan`: the opt-in tag, check<Plan>(), check_mesh(shape), apply<Plan>(model).
template <class S, class Plan>
concept parallel_strategy = strategy_opts_in<S> && strategy_checks_plan<S, Plan> &&
    strategy_checks_mesh<S> && strategy_applies<S, Plan>;

// ---- the order ----------------------------------------------------------------------------------

/// The horizontal slots' policies of `Plan` in the order the parallelize layer checks and applies
/// their strategies (DESIGN.md): peft -> tensor/sequence -> expert -> context -> data sharding ->
/// recompute. The one place this order is written.
template <class Plan>
struct strategy_order {
  template <template <class...> class F>
  using apply = F<typename Plan::peft, typename Plan::tensor_parallel,
                  typename Plan::expert_parallel, typename Plan::context_parallel,
                  typename Plan::data_parallel, typename Plan::activation_checkpointing>;
};

namespace detail {

template <class... Policies>
struct policy_list {
  template <class F>
  static constexpr void each(F&& f) {
    (f.template operator()<Policies>(), ...);
  }
};

/// The part a strategy lacks, as a static_assert naming it (then nothing else is reported).
template <class Policy, class Plan>
constexpr bool check_strategy_parts() {
  using S = strategy<Policy>;
  static_assert(strategy_opts_in<S>,
                "d9d::parallel::strategy<Policy>: does not opt in (shown with this error). Fix: "
                "declare `using strategy_concept = d9d::parallel::strategy_tag;` in it");
  static_assert(strategy_checks_plan<S, Plan>,
                "d9d::parallel::strategy<Policy>: lacks `template <class Plan> static constexpr "
                "void check()` (its compile-time rules; empty when there are none)");
  static_assert(strategy_checks_mesh<S>,
                "d9d::parallel::strategy<Policy>: lacks `static void check_mesh(const "
                "d9d::MeshShape&)` (its start-up rules for d9d::dynamic degrees; empty when there "
                "are none)");
  static_assert(strategy_applies<S, Plan>,
                "d9d::parallel::strategy<Policy>: lacks `template <class Plan> static void "
                "apply(d9d::parallel::ParallelModel&)` (what it does to the model)");
  return parallel_strategy<S, Plan>;
}

}  // namespace detail

/// Calls `f.template operator()<Policy>()` for each horizontal slot's policy of `Plan`, in
/// strategy_order.
template <class Plan, class F>
constexpr void for_each_strategy(F&& f) {
  strategy_order<Plan>::template apply<detail::policy_list>::each(std::forward<F>(f));
}

/// The compile-time rules of every strategy of `Plan` (a missing part of a strategy is reported by
/// name first; then each strategy's own static_asserts).
template <class Plan>
constexpr void check_plan() {
  // A malformed mesh has reported its own error; these rules read it and would add more.
  if constexpr (Plan::mesh::well_formed) {
    for_each_strategy<Plan>([]<class Policy>() {
      if constexpr (detail::check_strategy_parts<Policy, Plan>()) {
        strategy<Policy>::template check<Plan>();
      }
    });
  }
}

/// The same rules at start-up, for the resolved mesh (std::invalid_argument naming the key).
template <class Plan>
void check_mesh(const MeshShape& shape) {
  for_each_strategy<Plan>([&]<class Policy>() {
    if constexpr (parallel_strategy<strategy<Policy>, Plan>) {
      strategy<Policy>::check_mesh(shape);
    }
  });
}

/// What the strategies of `Plan` contribute to the data and the loss (their contribute parts, in
/// strategy order).
template <class Plan>
StepContributions step_contributions() {
  StepContributions out;
  for_each_strategy<Plan>([&]<class Policy>() {
    if constexpr (strategy_contributes<strategy<Policy>, Plan>) {
      strategy<Policy>::template contribute<Plan>(out);
    }
  });
  return out;
}

}  // namespace d9d::parallel
