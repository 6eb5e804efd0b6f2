// d9d/plan/degrees.hpp — parallelism degrees of a device mesh and its world size, static or
// d9d::dynamic.
//
//   using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<2>>;  // (d9d/plan/mesh.hpp)
//   static_assert(d9d::tp<2>::value == 2 && d9d::mesh_degree<d9d::tp<2>>);
//   static_assert(d9d::dp_shard<d9d::dynamic>::is_dynamic && d9d::world<8>::value == 8);
//
// A degree written as a number is checked by the compiler; d9d::dynamic defers it to start-up,
// where the same rule is checked against the real world size. Each degree's `name` is its key in
// d9d::MeshShape and d9d::DynamicDegrees ("pp", "dp_shard", ...).
#pragma once

#include <type_traits>

namespace d9d {

/// A degree that comes from the configuration / world size at start-up instead of the type.
inline constexpr int dynamic = -1;

namespace detail {

/// The named dimensions of a device mesh, in the field order of d9d::MeshShape.
enum class mesh_dim : int { pp, dp_replicate, dp_shard, cp_replicate, cp_shard, tp, ep };
inline constexpr int mesh_dim_count = 7;
/// Config keys of the dimensions, indexed by mesh_dim.
inline constexpr const char* mesh_dim_names[mesh_dim_count] = {
    "pp", "dp_replicate", "dp_shard", "cp_replicate", "cp_shard", "tp", "ep"};

/// What every degree type exposes: its value (or d9d::dynamic), whether it is dynamic, which
/// dimension it sets and that dimension's config key.
template <mesh_dim Dim, int N>
struct degree {
  static constexpr int value = N;
  static constexpr bool is_dynamic = N == dynamic;
  static constexpr mesh_dim dim = Dim;
  static constexpr const char* name = mesh_dim_names[static_cast<int>(Dim)];
};

}  // namespace detail

/// Pipeline-parallel degree (number of pipeline stages' ranks).
template <int N>
struct pp : detail::degree<detail::mesh_dim::pp, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::pp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::pp<1> for no "
                "pipeline parallelism, d9d::pp<d9d::dynamic> to take it from the config");
};

/// Data-parallel replication degree (DDP-style replicas).
template <int N>
struct dp_replicate : detail::degree<detail::mesh_dim::dp_replicate, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::dp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_replicate<1> for no replication, d9d::dp_replicate<d9d::dynamic> to take "
                "it from the config");
};

/// Data-parallel sharding degree (FSDP / ZeRO-3 shards).
template <int N>
struct dp_shard : detail::degree<detail::mesh_dim::dp_shard, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::dp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_shard<1> for no sharding, d9d::dp_shard<d9d::dynamic> to take it from the "
                "config");
};

/// Context-parallel replication degree.
template <int N>
struct cp_replicate : detail::degree<detail::mesh_dim::cp_replicate, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::cp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::cp_replicate<1> for none, d9d::cp_replicate<d9d::dynamic> to take it from "
                "the config");
};

/// Context-parallel sharding degree.
template <int N>
struct cp_shard : detail::degree<detail::mesh_dim::cp_shard, N> {
  static_assert(
      N == dynamic || N >= 1,
      "d9d::cp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
      "d9d::cp_shard<1> for none, d9d::cp_shard<d9d::dynamic> to take it from the config");
};

/// Tensor-parallel degree.
template <int N>
struct tp : detail::degree<detail::mesh_dim::tp, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::tp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::tp<1> for no "
                "tensor parallelism, d9d::tp<d9d::dynamic> to take it from the config");
};

/// Expert-parallel degree.
template <int N>
struct ep : detail::degree<detail::mesh_dim::ep, N> {
  static_assert(N == dynamic || N >= 1,
                "d9d::ep<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::ep<1> for no "
                "expert parallelism, d9d::ep<d9d::dynamic> to take it from the config");
};

/// The number of ranks the mesh spans (optional inside d9d::mesh<...>; checked against the
/// degrees).
template <int N>
struct world {
  static_assert(
      N == dynamic || N >= 1,
      "d9d::world<N>: the world size must be >= 1 or d9d::dynamic. Fix: d9d::world<8> for "
      "8 ranks, d9d::world<d9d::dynamic> (or no d9d::world) to take it from the launcher");
  static constexpr int value = N;
  static constexpr bool is_dynamic = N == dynamic;
};

/// A mesh degree type: d9d::pp, dp_replicate, dp_shard, cp_replicate, cp_shard, tp or ep <N>.
template <class T>
concept mesh_degree = requires {
  T::dim;
  T::value;
}
&&std::is_base_of_v<detail::degree<T::dim, T::value>, T>;

namespace detail {

template <class T>
inline constexpr bool is_world_v = false;
template <int N>
inline constexpr bool is_world_v<world<N>> = true;

/// What may appear inside d9d::mesh<...>: a degree or d9d::world<N>.
template <class T>
concept mesh_element = mesh_degree<T> || is_world_v<T>;

}  // namespace detail

}  // namespace d9d
