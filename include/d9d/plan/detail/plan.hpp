// d9d/plan/detail/plan.hpp — implementation of d9d::Plan<Ps...> (d9d/plan/plan.hpp): sorting the
// policies into slots, defaults, the argument checks and plan_with_t.
#pragma once

#include <type_traits>

#include <d9d/plan/degrees.hpp>
#include <d9d/plan/slots.hpp>

namespace d9d {

template <class... Ps>
struct Plan;

namespace detail {

template <class... Ts>
struct plan_type_list {};

// Concatenation, for folds in decltype only (never called).
template <class... As, class... Bs>
plan_type_list<As..., Bs...> operator+(plan_type_list<As...> /*lhs*/,
                                       plan_type_list<Bs...> /*rhs*/);

template <class P, class Slot>
consteval bool fills_slot() {
  if constexpr (plan_policy<P>) {
    return std::is_same_v<typename P::d9d_slot, Slot>;
  } else {
    return false;
  }
}

/// The policies among Ps that fill Slot, in order, as a plan_type_list.
template <class Slot, class... Ps>
using policies_for_slot_t =
    decltype((plan_type_list<>{} + ... +
              std::conditional_t<fills_slot<Ps, Slot>(), plan_type_list<Ps>, plan_type_list<>>{}));

/// The policy of one slot: its default when no policy fills it, else the first that does (Plan
/// reports a slot filled twice: check_one_policy_per_slot).
template <class Slot, class List>
struct slot_policy;
template <class Slot>
struct slot_policy<Slot, plan_type_list<>> {
  using type = typename Slot::default_policy;
};
template <class Slot, class P, class... Rest>
struct slot_policy<Slot, plan_type_list<P, Rest...>> {
  using type = P;
};

/// The policy that fills Slot in Plan<Ps...>.
template <class Slot, class... Ps>
using slot_policy_t = typename slot_policy<Slot, policies_for_slot_t<Slot, Ps...>>::type;

/// Plan<Ps...>'s bases: each slot's `member<Policy>`, which names the Plan member (`pipeline`,
/// ...).
template <class Slots, class... Ps>
struct plan_members;
template <class... Slots, class... Ps>
struct plan_members<plan_slot_list<Slots...>, Ps...>
    : Slots::template member<slot_policy_t<Slots, Ps...>>... {};

/// Checks that at most one of Ps fills each slot; the diagnostic shows the slot and its policies
/// as plan_dependent_false<Slot, Policies...>.
template <class Slot, class... Policies>
consteval bool check_one_policy_per_slot(plan_type_list<Policies...> /*policies*/) {
  if constexpr (sizeof...(Policies) <= 1) {
    return true;
  } else {
    static_assert(plan_dependent_false<Slot, Policies...>,
                  "d9d::Plan: two policies fill the same slot (shown with this error as <Slot, "
                  "Policies...>). Fix: keep one policy per slot; d9d::plan_with_t<Plan, Policy> "
                  "replaces the one a plan has");
    return true;
  }
}
template <class... Slots, class... Ps>
consteval bool check_plan_slots(plan_slot_list<Slots...> /*slots*/,
                                plan_type_list<Ps...> /*policies*/) {
  return (check_one_policy_per_slot<Slots>(policies_for_slot_t<Slots, Ps...>{}) && ...);
}

/// Plan<every slot's policy, in slot order>.
template <class Slots, class... Ps>
struct canonical_plan;
template <class... Slots, class... Ps>
struct canonical_plan<plan_slot_list<Slots...>, Ps...> {
  using type = Plan<slot_policy_t<Slots, Ps...>...>;
};

/// Checks one argument of Plan<...>; the diagnostic shows it as plan_dependent_false<P>.
template <class P>
consteval bool check_plan_argument() {
  if constexpr (plan_policy<P>) {
    return true;
  } else if constexpr (declares_plan_slot<P>) {
    static_assert(plan_dependent_false<P>,
                  "d9d::Plan: the policy's d9d_slot is not a slot of d9d::Plan. Fix: name one of "
                  "the d9d::slot tags (d9d/plan/slots.hpp), e.g. using d9d_slot = "
                  "d9d::slot::pipeline;");
    return true;
  } else if constexpr (mesh_element<P>) {
    static_assert(plan_dependent_false<P>,
                  "d9d::Plan: a mesh degree or d9d::world is not a plan policy. Fix: put it "
                  "inside d9d::mesh<...>, e.g. d9d::Plan<d9d::mesh<d9d::tp<2>>>");
    return true;
  } else {
    static_assert(
        plan_dependent_false<P>,
        "d9d::Plan: an argument is not a plan policy (its type is shown with this error); "
        "a policy names its slot in a nested type. Fix: pass policies such as "
        "d9d::mesh<...> or d9d::parallel::Fsdp, or declare using d9d_slot = "
        "d9d::slot::<slot>; in your policy");
    return true;
  }
}

/// Checks the new policy of plan_with_t; the diagnostic shows it as plan_dependent_false<X>.
template <class X>
consteval bool check_plan_with_policy() {
  if constexpr (plan_policy<X>) {
    return true;
  } else if constexpr (mesh_element<X>) {
    static_assert(plan_dependent_false<X>,
                  "d9d::plan_with_t: a mesh degree or d9d::world is not a plan policy. Fix: put "
                  "it inside d9d::mesh<...>, e.g. d9d::plan_with_t<MyPlan, d9d::mesh<d9d::tp<2>>>");
    return true;
  } else {
    static_assert(plan_dependent_false<X>,
                  "d9d::plan_with_t: the new policy is not a plan policy (its type is shown with "
                  "this error). Fix: pass a policy such as d9d::parallel::Fsdp, a type that "
                  "declares using d9d_slot = d9d::slot::<slot>;");
    return true;
  }
}

template <class X, bool = plan_policy<X>>
struct slot_of {
  using type = void;  // not a policy: replaces nothing (its diagnostic is reported)
};
template <class X>
struct slot_of<X, true> {
  using type = typename X::d9d_slot;
};

template <class Slots, class X, class... Ps>
struct replace_slot;
template <class... Slots, class X, class... Ps>
struct replace_slot<plan_slot_list<Slots...>, X, Ps...> {
  using type = Plan<std::conditional_t<std::is_same_v<Slots, typename slot_of<X>::type>, X,
                                       slot_policy_t<Slots, Ps...>>...>;
};

template <class P, class X>
consteval bool check_plan_with_plan() {
  static_assert(plan_dependent_false<P, X>,
                "d9d::plan_with_t: the first argument is not a d9d::Plan<...> (the arguments are "
                "shown with this error as <P, X>). Fix: pass the plan first and the new policy "
                "second, e.g. d9d::plan_with_t<MyPlan, d9d::parallel::Fsdp>");
  return true;
}

template <class P, class X>
struct plan_with {
  static_assert(check_plan_with_plan<P, X>());
  using type = P;
};
template <class... Ps, class X>
struct plan_with<Plan<Ps...>, X> {
  static_assert(check_plan_with_policy<X>());
  using type = typename replace_slot<plan_slots, X, Ps...>::type;
};

}  // namespace detail
}  // namespace d9d
