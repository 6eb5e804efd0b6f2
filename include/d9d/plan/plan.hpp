// d9d/plan/plan.hpp — d9d::Plan<Ps...>: the policies of a training run, one per slot, any order.
//
//   using MyPlan = d9d::Plan<d9d::precision::Bf16Mixed, d9d::mesh<d9d::dp_shard<4>, d9d::tp<2>>>;
//   static_assert(std::is_same_v<MyPlan::pipeline, d9d::pipeline::NoPipeline>);  // a default
//   using Sharded = d9d::plan_with_t<MyPlan, d9d::parallel::Fsdp>;                 // swap one slot
//
// Each policy (d9d::plan_policy) names the slot it fills; empty slots get their defaults
// (d9d/plan/defaults.hpp). Members re-export the policy of each slot: mesh, data_parallel,
// tensor_parallel, expert_parallel, context_parallel, pipeline, peft, precision,
// activation_checkpointing (the slots of d9d/plan/slots.hpp). A wrong argument fails to compile
// with a message that says the fix. This header needs only the plan folder; the policies other
// than the defaults come from their areas' headers (or <d9d/d9d.hpp>, which has them all).
#pragma once

#include <type_traits>

#include <d9d/plan/defaults.hpp>
#include <d9d/plan/detail/plan.hpp>
#include <d9d/plan/mesh.hpp>
#include <d9d/plan/slots.hpp>

namespace d9d {

/// The policies of a training run, one per slot, in any order; missing slots get defaults.
///
/// Members, one per slot (each a policy type): `mesh` (default d9d::mesh<>), `data_parallel`
/// (d9d::parallel::Replicate), `tensor_parallel` (d9d::parallel::NoTensorParallel),
/// `expert_parallel` (d9d::parallel::NoExpertParallel), `context_parallel`
/// (d9d::parallel::NoContextParallel), `pipeline` (d9d::pipeline::NoPipeline), `peft`
/// (d9d::peft::FullTune), `precision` (d9d::precision::Fp32), `activation_checkpointing`
/// (d9d::recompute::None). `canonical` is the same plan with every slot written out in that
/// order, so two plans that resolve alike have the same canonical.
template <class... Ps>
struct Plan : detail::plan_members<detail::plan_slots, Ps...> {
  static_assert((detail::check_plan_argument<Ps>() && ...));
  static_assert(detail::check_plan_slots(detail::plan_slots{}, detail::plan_type_list<Ps...>{}));

  using canonical = typename detail::canonical_plan<detail::plan_slots, Ps...>::type;
};

/// Whether `Plan` runs a pipeline schedule (its pipeline slot is not d9d::pipeline::NoPipeline):
/// the step is then a pipeline program over this rank's stages, else each rank runs the whole
/// model. The components specialised on the Plan (the step, the strategies) read it.
template <class Plan>
inline constexpr bool plan_has_pipeline =
    !std::is_same_v<typename Plan::pipeline, pipeline::NoPipeline>;

/// Plan P with the slot that policy X fills replaced by X (in canonical form).
template <class P, class X>
using plan_with_t = typename detail::plan_with<P, X>::type;

}  // namespace d9d
