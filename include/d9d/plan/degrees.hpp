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

/// A degree that comes from the configuration / world size at start-up instead of the type. An
/// enumerator (of the unscoped enum dynamic_t) rather than an int constant, so that compilers spell
/// a dynamic degree by name in type names and diagnostics, d9d::dp_shard<d9d::dynamic>, not
/// d9d::dp_shard<-1>; it converts to the int -1 wherever a degree is a number (d9d::MeshShape,
/// DynamicDegrees, comparisons).
enum dynamic_t : int { dynamic = -1 };  // NOLINT(performance-enum-size): compared with ints

namespace detail {

/// Whether a degree's template argument is d9d::dynamic (its type, not the number -1).
template <auto N>
inline constexpr bool is_dynamic_arg = std::is_same_v<std::remove_cvref_t<decltype(N)>, dynamic_t>;
/// Whether a degree's template argument is valid: d9d::dynamic, or an integer >= 1.
template <auto N>
constexpr bool valid_degree_arg() {
  if constexpr (is_dynamic_arg<N>) {
    return true;
  } else {
    return std::is_integral_v<decltype(N)> && N >= 1;
  }
}

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
  static constexpr bool is_dynamic = N == -1;
  static constexpr mesh_dim dim = Dim;
  static constexpr const char* name = mesh_dim_names[static_cast<int>(Dim)];
};

}  // namespace detail

/// Pipeline-parallel degree (number of pipeline stages' ranks).
template <auto N>
struct pp
    : detail::degree<detail::mesh_dim::pp, (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::pp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::pp<1> for no "
                "pipeline parallelism, d9d::pp<d9d::dynamic> to take it from the config");
};

/// Data-parallel replication degree (DDP-style replicas).
template <auto N>
struct dp_replicate : detail::degree<detail::mesh_dim::dp_replicate,
                                     (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::dp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_replicate<1> for no replication, d9d::dp_replicate<d9d::dynamic> to take "
                "it from the config");
};

/// Data-parallel sharding degree (FSDP / ZeRO-3 shards).
template <auto N>
struct dp_shard : detail::degree<detail::mesh_dim::dp_shard,
                                 (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::dp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::dp_shard<1> for no sharding, d9d::dp_shard<d9d::dynamic> to take it from the "
                "config");
};

/// Context-parallel replication degree.
template <auto N>
struct cp_replicate : detail::degree<detail::mesh_dim::cp_replicate,
                                     (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::cp_replicate<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
                "d9d::cp_replicate<1> for none, d9d::cp_replicate<d9d::dynamic> to take it from "
                "the config");
};

/// Context-parallel sharding degree.
template <auto N>
struct cp_shard : detail::degree<detail::mesh_dim::cp_shard,
                                 (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(
      detail::valid_degree_arg<N>(),
      "d9d::cp_shard<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: "
      "d9d::cp_shard<1> for none, d9d::cp_shard<d9d::dynamic> to take it from the config");
};

/// Tensor-parallel degree.
template <auto N>
struct tp
    : detail::degree<detail::mesh_dim::tp, (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::tp<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::tp<1> for no "
                "tensor parallelism, d9d::tp<d9d::dynamic> to take it from the config");
};

/// Expert-parallel degree.
template <auto N>
struct ep
    : detail::degree<detail::mesh_dim::ep, (detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N))> {
  static_assert(detail::valid_degree_arg<N>(),
                "d9d::ep<N>: a mesh degree must be >= 1 or d9d::dynamic. Fix: d9d::ep<1> for no "
                "expert parallelism, d9d::ep<d9d::dynamic> to take it from the config");
};

/// The number of ranks the mesh spans (optional inside d9d::mesh<...>; checked against the
/// degrees).
template <auto N>
struct world {
  static_assert(
      detail::valid_degree_arg<N>(),
      "d9d::world<N>: the world size must be >= 1 or d9d::dynamic. Fix: d9d::world<8> for "
      "8 ranks, d9d::world<d9d::dynamic> (or no d9d::world) to take it from the launcher");
  static constexpr int value = detail::is_dynamic_arg<N> ? -1 : static_cast<int>(N);
  static constexpr bool is_dynamic = detail::is_dynamic_arg<N>;
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
template <auto N>
inline constexpr bool is_world_v<world<N>> = true;

/// Degree<V> for a value that may be -1 (d9d::dynamic): Degree<d9d::dynamic> then, so that one
/// degree has one type however it was computed.
template <template <auto> class Degree, int V>
using degree_for = std::conditional_t<V == -1, Degree<dynamic>, Degree<(V == -1 ? 1 : V)>>;

/// What may appear inside d9d::mesh<...>: a degree or d9d::world<N>.
template <class T>
concept mesh_element = mesh_degree<T> || is_world_v<T>;

}  // namespace detail

}  // namespace d9d
