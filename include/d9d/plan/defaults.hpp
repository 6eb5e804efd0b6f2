// d9d/plan/defaults.hpp — the default policy of every d9d::Plan slot.
//
//   using Defaults = d9d::Plan<>;   // every member below
//   static_assert(std::is_same_v<Defaults::data_parallel, d9d::parallel::Replicate>);
//   static_assert(Defaults::precision::parameters == d9d::precision::Dtype::float32);
//
// Each models d9d::plan_policy for its slot. They live here, not in their areas' headers, so the
// plan folder needs nothing from the areas (d9d/plan/plan.hpp includes only d9d/plan/); each
// area's policies header includes this one and adds its other policies. Every default states the
// facts its area's components read (see the area's policies header).
#pragma once

#include <d9d/plan/slots.hpp>

namespace d9d {

namespace parallel {

/// Every data-parallel rank holds the whole model; gradients are all-reduced during backward
/// (DDP). The default of the data_parallel slot.
struct Replicate {
  using d9d_slot = slot::data_parallel;
  static constexpr bool shards_parameters = false;
};

/// No tensor parallelism (the mesh's tp must be 1). The default of the tensor_parallel slot.
struct NoTensorParallel {
  using d9d_slot = slot::tensor_parallel;
};

/// No expert parallelism (the mesh's ep must be 1). The default of the expert_parallel slot.
struct NoExpertParallel {
  using d9d_slot = slot::expert_parallel;
};

/// No context parallelism (the mesh's cp_shard and cp_replicate must be 1). The default of the
/// context_parallel slot.
struct NoContextParallel {
  using d9d_slot = slot::context_parallel;
};

}  // namespace parallel

namespace pipeline {

/// The whole model runs as one stage on each rank (use with pp = 1). The default of the pipeline
/// slot.
struct NoPipeline {
  using d9d_slot = slot::pipeline;
};

}  // namespace pipeline

namespace peft {

/// Every parameter of the model trains. The default of the peft slot.
struct FullTune {
  using d9d_slot = slot::peft;
};

}  // namespace peft

namespace precision {

/// The floating-point formats a precision policy can name (kept free of LibTorch headers).
enum class Dtype { float32, float64, bfloat16 };

/// Parameters, compute and gradients in float32. The default of the precision slot.
struct Fp32 {
  using d9d_slot = slot::precision;
  static constexpr Dtype parameters = Dtype::float32;
  static constexpr Dtype compute = Dtype::float32;
  static constexpr Dtype reduce = Dtype::float32;
};

}  // namespace precision

namespace recompute {

/// What a recomputed block recomputes: its whole body, or only its attention part (the input
/// norm, the projections, the attention and the output projection; d9d::model::Block::Part).
enum class Scope : unsigned char { block, attention };

/// Every activation backward needs is kept from the forward pass. The default of the
/// activation_checkpointing slot.
struct None {
  using d9d_slot = slot::activation_checkpointing;
  /// Recompute decoder block i when every_nth > 0 and i % every_nth == every_nth - 1.
  static constexpr int every_nth = 0;
  /// What such a block recomputes (a policy that does not state it recomputes whole blocks).
  static constexpr Scope scope = Scope::block;
};

}  // namespace recompute

}  // namespace d9d
