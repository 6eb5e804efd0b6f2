// d9d/plan/degrees.hpp — parallelism degrees of a device mesh, static or d9d::dynamic.
//
//   using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<2>>;  // (mesh<> comes with the
//   plan) static_assert(d9d::tp<2>::value == 2 && !d9d::tp<2>::is_dynamic);
//   static_assert(d9d::dp_shard<d9d::dynamic>::is_dynamic);
//
// A degree written as a number is checked by the compiler; d9d::dynamic defers it to start-up,
// where the same rule is checked against the real world size.
#pragma once

namespace d9d {

/// A degree that comes from the configuration / world size at start-up instead of the type.
inline constexpr int dynamic = -1;

namespace detail {

/// What every degree type exposes: its value (or d9d::dynamic) and whether it is dynamic.
template <int N>
struct degree {
  static constexpr int value = N;
  static constexpr bool is_dynamic = N == dynamic;
};

}  // namespace detail

/// Pipeline-parallel degree (number of pipeline stages' ranks).
template <int N>
struct pp : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::pp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::pp<1> for no "
                "pipeline parallelism, d9d::pp<d9d::dynamic> to take it from the config");
};

/// Data-parallel replication degree (DDP-style replicas).
template <int N>
struct dp_replicate : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::dp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_replicate<1> for no replication, d9d::dp_replicate<d9d::dynamic> to take "
                "it from the config");
};

/// Data-parallel sharding degree (FSDP / ZeRO-3 shards).
template <int N>
struct dp_shard : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::dp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_shard<1> for no sharding, d9d::dp_shard<d9d::dynamic> to take it from the "
                "config");
};

/// Context-parallel replication degree.
template <int N>
struct cp_replicate : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::cp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::cp_replicate<1> for none, d9d::cp_replicate<d9d::dynamic> to take it from "
                "the config");
};

/// Context-parallel sharding degree.
template <int N>
struct cp_shard : detail::degree<N> {
  static_assert(
      N == dynamic || N >= 1,
      "d9d::cp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
      "d9d::cp_shard<1> for none, d9d::cp_shard<d9d::dynamic> to take it from the config");
};

/// Tensor-parallel degree.
template <int N>
struct tp : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::tp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::tp<1> for no "
                "tensor parallelism, d9d::tp<d9d::dynamic> to take it from the config");
};

/// Expert-parallel degree.
template <int N>
struct ep : detail::degree<N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::ep<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::ep<1> for no "
                "expert parallelism, d9d::ep<d9d::dynamic> to take it from the config");
};

}  // namespace d9d
