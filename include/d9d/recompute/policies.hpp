// d9d/recompute/policies.hpp — activation recompute (checkpointing) policies: which decoder blocks
// keep their activations for backward and which recompute them.
//
//   using MyPlan = d9d::Plan<d9d::parallel::Fsdp, d9d::recompute::EveryNth<2>>;
//   static_assert(MyPlan::activation_checkpointing::every_nth == 2);   // blocks 1, 3, 5, ...
//   static_assert(d9d::Plan<>::activation_checkpointing::every_nth == 0);  // None, the default
//
// Each models d9d::plan_policy for d9d::slot::activation_checkpointing and states `every_nth`:
// block i (0-based, in forward order) is recomputed when every_nth > 0 and
// i % every_nth == every_nth - 1. A recomputed block keeps only its input during forward and runs
// its forward again inside its backward: memory traded for about one more forward of that block.
// The parallelize layer applies it last, around everything the other strategies did to the block
// (d9d/parallel/parallelize.hpp).
#pragma once

#include <d9d/plan/defaults.hpp>  // None, the default

namespace d9d::recompute {

/// Every decoder block recomputes its activations in backward.
struct Full {
  using d9d_slot = slot::activation_checkpointing;
  static constexpr int every_nth = 1;
};

/// Every K-th decoder block recomputes its activations (blocks K-1, 2K-1, ...).
template <int K>
struct EveryNth {
  static_assert(K >= 1,
                "d9d::recompute::EveryNth<K>: K must be >= 1 (K = 1 recomputes every block). Fix: "
                "use d9d::recompute::None to keep every activation");
  using d9d_slot = slot::activation_checkpointing;
  static constexpr int every_nth = K;
};

}  // namespace d9d::recompute
