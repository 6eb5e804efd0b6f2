// d9d/plan/mesh.hpp — d9d::mesh<...>: the device mesh of a Plan, as degree types in any order.
//
//   using Mesh = d9d::mesh<d9d::tp<2>, d9d::dp_shard<d9d::dynamic>, d9d::world<8>>;
//   static_assert(Mesh::dp_shard::value == 4 && Mesh::static_shape().tp == 2);  // inferred: 8/2
//   d9d::MeshShape shape = d9d::resolve_mesh<d9d::mesh<d9d::tp<2>, d9d::dp_shard<d9d::dynamic>>>(
//       /*world_size=*/8, {.dp_shard = cfg.dp_shard});  // or inferred from the world when empty
//
// Models d9d::plan_policy for d9d::slot::mesh. Missing degrees are 1. Static degrees are checked
// by the compiler (they multiply to the declared world, ep divides the ranks of a stage); one
// d9d::dynamic degree next to a static world is inferred at compile time. The rest is resolved at
// start-up by d9d::resolve_mesh, with the same rules and errors that name the config key.
#pragma once

#include <optional>

#include <d9d/core/mesh_shape.hpp>
#include <d9d/plan/degrees.hpp>
#include <d9d/plan/detail/mesh.hpp>
#include <d9d/plan/slots.hpp>

namespace d9d {

/// The mesh degrees of the Plan, resolved: every degree type (d9d::pp ... d9d::ep) and an
/// optional d9d::world<N>, each at most once, in any order.
template <class... Elems>
struct mesh {
 private:
  static constexpr const detail::mesh_facts& facts_ = detail::mesh_facts_v<Elems...>;

 public:
  using d9d_slot = slot::mesh;

  static_assert(facts_.count_of(detail::mesh_dim::pp) <= 1,
                "d9d::mesh: d9d::pp is given more than once. Fix: give it once, with the product "
                "of the values");
  static_assert(
      facts_.count_of(detail::mesh_dim::dp_replicate) <= 1,
      "d9d::mesh: d9d::dp_replicate is given more than once. Fix: give it once, with the product "
      "of the values");
  static_assert(
      facts_.count_of(detail::mesh_dim::dp_shard) <= 1,
      "d9d::mesh: d9d::dp_shard is given more than once. Fix: give it once, with the product "
      "of the values");
  static_assert(
      facts_.count_of(detail::mesh_dim::cp_replicate) <= 1,
      "d9d::mesh: d9d::cp_replicate is given more than once. Fix: give it once, with the product "
      "of the values");
  static_assert(
      facts_.count_of(detail::mesh_dim::cp_shard) <= 1,
      "d9d::mesh: d9d::cp_shard is given more than once. Fix: give it once, with the product "
      "of the values");
  static_assert(facts_.count_of(detail::mesh_dim::tp) <= 1,
                "d9d::mesh: d9d::tp is given more than once. Fix: give it once, with the product "
                "of the values");
  static_assert(facts_.count_of(detail::mesh_dim::ep) <= 1,
                "d9d::mesh: d9d::ep is given more than once. Fix: give it once, with the product "
                "of the values");
  static_assert(facts_.world_count <= 1,
                "d9d::mesh: d9d::world is given more than once. Fix: give it once");
  static_assert(
      detail::mesh_degrees_multiply_to_world<facts_.static_product, facts_.world_for_product>,
      "d9d::mesh: the degrees do not multiply to the declared d9d::world<N> (shown with this "
      "error as <pp * dp_replicate * dp_shard * cp_replicate * cp_shard * tp, N>). Fix: choose "
      "degrees whose product is N, or make one degree d9d::dynamic to infer it");
  static_assert(
      detail::mesh_static_degrees_divide_world<facts_.static_product, facts_.world_for_inference>,
      "d9d::mesh: the product of the static degrees does not divide the declared d9d::world<N> "
      "(shown with this error as <product, N>), so no d9d::dynamic degree can fill the rest. "
      "Fix: choose static degrees whose product divides N");
  static_assert(detail::mesh_ep_divides_stage<facts_.ep_for_rule, facts_.stage_for_rule>,
                "d9d::mesh: ep does not divide dp_replicate * dp_shard * cp_replicate * cp_shard * "
                "tp, the ranks of one pipeline stage (shown with this error as <ep, product>). "
                "Fix: choose ep among the divisors of that product");

  /// Whether the mesh passes every rule above. When it does not, the rules of the strategies and
  /// of the trainer that read the mesh are skipped, so each mistake gives one error.
  static constexpr bool well_formed =
      facts_.well_formed &&
      detail::mesh_degrees_multiply_to_world<facts_.static_product, facts_.world_for_product> &&
      detail::mesh_static_degrees_divide_world<facts_.static_product, facts_.world_for_inference> &&
      detail::mesh_ep_divides_stage<facts_.ep_for_rule, facts_.stage_for_rule>;

  /// The resolved degree types: as written, 1 when missing, or inferred from a static world.
  using pp = detail::degree_for<::d9d::pp, facts_.of(detail::mesh_dim::pp)>;
  using dp_replicate =
      detail::degree_for<::d9d::dp_replicate, facts_.of(detail::mesh_dim::dp_replicate)>;
  using dp_shard = detail::degree_for<::d9d::dp_shard, facts_.of(detail::mesh_dim::dp_shard)>;
  using cp_replicate =
      detail::degree_for<::d9d::cp_replicate, facts_.of(detail::mesh_dim::cp_replicate)>;
  using cp_shard = detail::degree_for<::d9d::cp_shard, facts_.of(detail::mesh_dim::cp_shard)>;
  using tp = detail::degree_for<::d9d::tp, facts_.of(detail::mesh_dim::tp)>;
  using ep = detail::degree_for<::d9d::ep, facts_.of(detail::mesh_dim::ep)>;
  /// The world size: as declared, else the product of the degrees when they are all static, else
  /// d9d::world<d9d::dynamic>.
  using world = detail::degree_for<::d9d::world, facts_.world>;

  /// Every degree (and so the world) is known at compile time.
  static constexpr bool is_static = facts_.is_static;

  /// The shape, at compile time; only for a static mesh (is_static).
  [[nodiscard]] static constexpr MeshShape static_shape() {
    static_assert(is_static,
                  "d9d::mesh::static_shape(): the mesh has d9d::dynamic degrees, known only at "
                  "start-up. Fix: call d9d::resolve_mesh<Mesh>(world_size, given) there, or test "
                  "Mesh::is_static first");
    return {.pp = pp::value,
            .dp_replicate = dp_replicate::value,
            .dp_shard = dp_shard::value,
            .cp_replicate = cp_replicate::value,
            .cp_shard = cp_shard::value,
            .tp = tp::value,
            .ep = ep::value};
  }
};

/// The d9d::dynamic degrees of a mesh as the configuration gives them, by config key. An empty
/// optional: not given. Filled with designated initializers: `{.dp_shard = 4, .tp = 2}` (the
/// default member initializers keep -Wmissing-field-initializers quiet about the others).
struct DynamicDegrees {
  std::optional<int> pp = std::nullopt;
  std::optional<int> dp_replicate = std::nullopt;
  std::optional<int> dp_shard = std::nullopt;
  std::optional<int> cp_replicate = std::nullopt;
  std::optional<int> cp_shard = std::nullopt;
  std::optional<int> tp = std::nullopt;
  std::optional<int> ep = std::nullopt;
};

/// The mesh's shape on a world of `world_size` ranks: static degrees from the type, d9d::dynamic
/// ones from `given`, and one dynamic degree that is not given inferred from `world_size`; then
/// MeshShape::check. Throws std::invalid_argument naming the config key, the value and the fix.
/// Uses no communication: every rank gets the same shape, or the same error.
template <class Mesh>
[[nodiscard]] MeshShape resolve_mesh(int world_size, const DynamicDegrees& given = {}) {
  if constexpr (detail::is_mesh_v<Mesh>) {
    const detail::mesh_spec spec{
        .degree = {Mesh::pp::value, Mesh::dp_replicate::value, Mesh::dp_shard::value,
                   Mesh::cp_replicate::value, Mesh::cp_shard::value, Mesh::tp::value,
                   Mesh::ep::value},
        .world = detail::mesh_declared_world<Mesh>};
    const detail::mesh_given values{.degree = {given.pp, given.dp_replicate, given.dp_shard,
                                               given.cp_replicate, given.cp_shard, given.tp,
                                               given.ep}};
    return detail::resolve_mesh_spec(spec, world_size, values);
  } else {
    static_assert(detail::plan_dependent_false<Mesh>,
                  "d9d::resolve_mesh<Mesh>: Mesh must be a d9d::mesh<...>. Fix: pass the plan's "
                  "mesh, d9d::resolve_mesh<MyPlan::mesh>(world_size, given)");
    return {};
  }
}

}  // namespace d9d
