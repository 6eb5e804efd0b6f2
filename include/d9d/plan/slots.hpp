// d9d/plan/slots.hpp — the slots of a d9d::Plan and the d9d::plan_policy concept.
//
//   struct MySchedule {
//     using d9d_slot = d9d::slot::pipeline;  // the opt-in tag: "I fill the pipeline slot"
//   };
//   static_assert(d9d::plan_policy<MySchedule> && !d9d::plan_policy<int>);
//
// A policy opts in by naming its slot in a nested `d9d_slot` type; nothing is a policy by
// accident. Each slot tag names its default policy and the Plan member that re-exports it.
// Adding a slot: declare its tag below and list it in detail::plan_slots; d9d::Plan, its
// `canonical` form, d9d::plan_with_t and the diagnostics pick it up from that list.
#pragma once

#include <type_traits>

namespace d9d {

// The defaults, forward-declared: d9d/plan/defaults.hpp defines them (d9d/plan/plan.hpp includes
// it), and the areas' policy headers include that one and add their other policies.
template <class... Elems>
struct mesh;
namespace parallel {
struct Replicate;
struct NoTensorParallel;
struct NoExpertParallel;
struct NoContextParallel;
}  // namespace parallel
namespace pipeline {
struct NoPipeline;
}  // namespace pipeline
namespace peft {
struct FullTune;
}  // namespace peft
namespace precision {
struct Fp32;
}  // namespace precision
namespace recompute {
struct None;
}  // namespace recompute

/// Slot tags: what a policy names in `using d9d_slot = ...;`.
namespace slot {

/// The device mesh: d9d::mesh<degrees..., world>. Plan member `mesh`; default d9d::mesh<>.
struct mesh {
  using default_policy = ::d9d::mesh<>;
  template <class P>
  struct member {
    using mesh = P;
  };
};

/// How the data-parallel ranks share the model (d9d/parallel/policies.hpp). Plan member
/// `data_parallel`; default d9d::parallel::Replicate.
struct data_parallel {
  using default_policy = ::d9d::parallel::Replicate;
  template <class P>
  struct member {
    using data_parallel = P;
  };
};

/// How the tp ranks split each layer (tensor and sequence parallelism). Plan member
/// `tensor_parallel`; default d9d::parallel::NoTensorParallel.
struct tensor_parallel {
  using default_policy = ::d9d::parallel::NoTensorParallel;
  template <class P>
  struct member {
    using tensor_parallel = P;
  };
};

/// How the ep ranks split a mixture-of-experts layer's experts. Plan member `expert_parallel`;
/// default d9d::parallel::NoExpertParallel.
struct expert_parallel {
  using default_policy = ::d9d::parallel::NoExpertParallel;
  template <class P>
  struct member {
    using expert_parallel = P;
  };
};

/// How the cp ranks split the sequence inside attention. Plan member `context_parallel`; default
/// d9d::parallel::NoContextParallel.
struct context_parallel {
  using default_policy = ::d9d::parallel::NoContextParallel;
  template <class P>
  struct member {
    using context_parallel = P;
  };
};

/// The pipeline schedule (d9d/pipeline/policies.hpp). Plan member `pipeline`; default
/// d9d::pipeline::NoPipeline.
struct pipeline {
  using default_policy = ::d9d::pipeline::NoPipeline;
  template <class P>
  struct member {
    using pipeline = P;
  };
};

/// Parameter-efficient fine-tuning (d9d/peft/policies.hpp). Plan member `peft`; default
/// d9d::peft::FullTune.
struct peft {
  using default_policy = ::d9d::peft::FullTune;
  template <class P>
  struct member {
    using peft = P;
  };
};

/// Numeric precision of parameters and compute (d9d/precision/policies.hpp). Plan member
/// `precision`; default d9d::precision::Fp32.
struct precision {
  using default_policy = ::d9d::precision::Fp32;
  template <class P>
  struct member {
    using precision = P;
  };
};

/// Which activations are recomputed in backward instead of kept (d9d/recompute/policies.hpp).
/// Plan member `activation_checkpointing`; default d9d::recompute::None.
struct activation_checkpointing {
  using default_policy = ::d9d::recompute::None;
  template <class P>
  struct member {
    using activation_checkpointing = P;
  };
};

}  // namespace slot

namespace detail {

/// For `static_assert(plan_dependent_false<T>, "...")` in branches that must not be instantiated.
template <class...>
inline constexpr bool plan_dependent_false = false;

template <class... Slots>
struct plan_slot_list {};

/// Every slot of a Plan, in the order of Plan<...>::canonical.
using plan_slots = plan_slot_list<slot::mesh, slot::data_parallel, slot::tensor_parallel,
                                  slot::expert_parallel, slot::context_parallel, slot::pipeline,
                                  slot::peft, slot::precision, slot::activation_checkpointing>;

template <class S, class... Slots>
consteval bool is_listed_slot(plan_slot_list<Slots...> /*slots*/) {
  return (std::is_same_v<S, Slots> || ...);
}

}  // namespace detail

/// A slot tag of d9d::Plan (one of the d9d::slot types).
template <class S>
concept plan_slot = detail::is_listed_slot<S>(detail::plan_slots{});

/// A type that opts in to being a plan policy: it has a nested `d9d_slot` type.
template <class P>
concept declares_plan_slot = requires {
  typename P::d9d_slot;
};

/// A plan policy: it names, in `using d9d_slot = ...;`, the d9d::slot it fills.
template <class P>
concept plan_policy = declares_plan_slot<P> && plan_slot<typename P::d9d_slot>;

}  // namespace d9d
