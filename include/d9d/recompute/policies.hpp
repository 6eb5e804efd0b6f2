// d9d/recompute/policies.hpp — activation recompute (checkpointing) policies: which decoder blocks
// keep their activations for backward and which recompute them.
//
//   using MyPlan = d9d::Plan<d9d::parallel::Fsdp, d9d::recompute::EveryNth<2>>;
//   static_assert(MyPlan::activation_checkpointing::every_nth == 2);   // blocks 1, 3, 5, ...
//   static_assert(d9d::Plan<>::activation_checkpointing::every_nth == 0);  // None, the default
//   using Selective = d9d::Plan<d9d::parallel::Fsdp, d9d::recompute::Attention<>>;
//
// Each models d9d::plan_policy for d9d::slot::activation_checkpointing and states `every_nth`:
// block i (0-based, in forward order) is recomputed when every_nth > 0 and
// i % every_nth == every_nth - 1, and `scope`: what of it. Scope::block (None, Full, EveryNth): the
// block keeps only its input during forward and runs its forward again inside its backward —
// memory traded for about one more forward of that block. Scope::attention (Attention<K>,
// selective recompute): only the block's attention part is recomputed, so the MLP keeps its
// activations and its GEMMs (two thirds of a dense layer's FLOPs) run once; the block then needs
// to declare that part (d9d::model::Block::Part, as Qwen3's layers do), else parallelize throws.
// The parallelize layer applies it last, around everything the other strategies did to the block
// (d9d/parallel/parallelize.hpp).
#pragma once

#include <d9d/plan/defaults.hpp>  // None, the default

namespace d9d::recompute {

/// Every decoder block recomputes its activations in backward.
struct Full {
  using d9d_slot = slot::activation_checkpointing;
  static constexpr int every_nth = 1;
  static constexpr Scope scope = Scope::block;
};

/// Every K-th decoder block recomputes its activations (blocks K-1, 2K-1, ...).
template <int K>
struct EveryNth {
  static_assert(K >= 1,
                "d9d::recompute::EveryNth<K>: K must be >= 1 (K = 1 recomputes every block). Fix: "
                "use d9d::recompute::None to keep every activation");
  using d9d_slot = slot::activation_checkpointing;
  static constexpr int every_nth = K;
  static constexpr Scope scope = Scope::block;
};

/// Selective recompute: every K-th decoder block (blocks K-1, 2K-1, ...; K = 1: every block)
/// recomputes only its attention part in backward. Its input norm's and projections' outputs,
/// queries, keys, values and the attention's output are not kept; the MLP keeps everything.
template <int K = 1>
struct Attention {
  static_assert(K >= 1,
                "d9d::recompute::Attention<K>: K must be >= 1 (K = 1 recomputes every block's "
                "attention). Fix: use d9d::recompute::None to keep every activation");
  using d9d_slot = slot::activation_checkpointing;
  static constexpr int every_nth = K;
  static constexpr Scope scope = Scope::attention;
};

}  // namespace d9d::recompute
