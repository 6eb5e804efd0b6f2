// d9d/parallel/policies.hpp — data-parallel policies: how the dp_replicate / dp_shard ranks of the
// mesh share the model.
//
//   using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<8>>, d9d::parallel::Fsdp>;
//   static_assert(std::is_same_v<MyPlan::data_parallel, d9d::parallel::Fsdp>);
//   static_assert(std::is_same_v<d9d::Plan<>::data_parallel, d9d::parallel::Replicate>);
//
// Each models d9d::plan_policy for d9d::slot::data_parallel. Tags for now: the components that
// implement them (gradient all-reduce, parameter sharding) are specialised on these types.
#pragma once

#include <d9d/plan/slots.hpp>

namespace d9d::parallel {

/// Every data-parallel rank holds the whole model and gradients are all-reduced (DDP). The
/// default of the data_parallel slot.
struct Replicate {
  using d9d_slot = slot::data_parallel;
};

/// Fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state are sharded
/// over dp_shard and gathered around each use; replicated over dp_replicate (HSDP when both > 1).
struct Fsdp {
  using d9d_slot = slot::data_parallel;
};

}  // namespace d9d::parallel
