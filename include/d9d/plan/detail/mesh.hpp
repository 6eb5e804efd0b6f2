// d9d/plan/detail/mesh.hpp — implementation of d9d::mesh<...> (d9d/plan/mesh.hpp): the static
// facts of a mesh computed at compile time, and the run-time resolution to a d9d::MeshShape.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>

#include <d9d/core/mesh_shape.hpp>
#include <d9d/plan/degrees.hpp>
#include <d9d/plan/slots.hpp>

namespace d9d::detail {

inline constexpr int mesh_ep_index = static_cast<int>(mesh_dim::ep);

/// What d9d::mesh<Elems...> knows at compile time. Rule inputs are d9d::dynamic where the rule
/// does not apply (something dynamic, or the arguments are malformed), so that its check passes.
struct mesh_facts {
  int degree[mesh_dim_count] = {1, 1, 1, 1, 1, 1, 1};  // a value, or d9d::dynamic
  int count[mesh_dim_count] = {};                      // how often each degree was given
  int world = dynamic;                                 // declared, or the product when static
  int declared_world = dynamic;                        // as given in d9d::world<N>
  int world_count = 0;
  bool well_formed = true;  // only valid degrees and world, each at most once
  bool is_static = false;   // every degree known

  long long static_product = 1;       // pp * dp_replicate * ... * tp over the static ones
  int world_for_product = dynamic;    // the declared world when pp..tp are all static
  int world_for_inference = dynamic;  // the declared world when some of pp..tp is dynamic
  int ep_for_rule = dynamic;
  long long stage_for_rule = dynamic;  // dp_replicate * dp_shard * cp_replicate * cp_shard * tp

  [[nodiscard]] constexpr int of(mesh_dim dim) const { return degree[static_cast<int>(dim)]; }
  [[nodiscard]] constexpr int count_of(mesh_dim dim) const { return count[static_cast<int>(dim)]; }
};

template <class T>
consteval void add_mesh_element(mesh_facts& facts) {
  if constexpr (mesh_degree<T>) {
    const int index = static_cast<int>(T::dim);
    if (facts.count[index]++ == 0) {
      facts.degree[index] = T::value;
    }
    if (T::value != dynamic && T::value < 1) {
      facts.well_formed = false;  // the degree's own static_assert reports it
    }
  } else if constexpr (is_world_v<T>) {
    if (facts.world_count++ == 0) {
      facts.world = T::value;
      facts.declared_world = T::value;
    }
    if (T::value != dynamic && T::value < 1) {
      facts.well_formed = false;  // d9d::world's own static_assert reports it
    }
  } else {
    static_assert(plan_dependent_false<T>,
                  "d9d::mesh: an argument is not a mesh degree or d9d::world<N> (its type is shown "
                  "with this error). Fix: use only d9d::pp, d9d::dp_replicate, d9d::dp_shard, "
                  "d9d::cp_replicate, d9d::cp_shard, d9d::tp, d9d::ep and d9d::world inside "
                  "d9d::mesh<...>; policies go next to the mesh in d9d::Plan<...>");
    facts.well_formed = false;
  }
}

template <class... Elems>
consteval mesh_facts make_mesh_facts() {
  mesh_facts facts;
  (add_mesh_element<Elems>(facts), ...);
  for (const int count : facts.count) {
    facts.well_formed = facts.well_formed && count <= 1;
  }
  facts.well_formed = facts.well_formed && facts.world_count <= 1;
  if (!facts.well_formed) {
    return facts;
  }

  // pp * dp_replicate * dp_shard * cp_replicate * cp_shard * tp spans the world; ep does not.
  int dynamic_dims = 0;
  int dynamic_at = -1;
  for (int i = 0; i < mesh_dim_count; ++i) {
    if (i == mesh_ep_index) {
      continue;
    }
    if (facts.degree[i] == dynamic) {
      ++dynamic_dims;
      dynamic_at = i;
    } else {
      facts.static_product *= facts.degree[i];
    }
  }
  if (facts.world != dynamic) {
    if (dynamic_dims == 0) {
      facts.world_for_product = facts.world;
    } else {
      facts.world_for_inference = facts.world;
      if (dynamic_dims == 1 && facts.world % facts.static_product == 0) {
        facts.degree[dynamic_at] = static_cast<int>(facts.world / facts.static_product);
      }
    }
  } else if (dynamic_dims == 0 && facts.static_product <= 0x7fffffff) {
    facts.world = static_cast<int>(facts.static_product);
  }

  long long stage = 1;
  facts.is_static = true;
  for (int i = 0; i < mesh_dim_count; ++i) {
    facts.is_static = facts.is_static && facts.degree[i] != dynamic;
    if (i != static_cast<int>(mesh_dim::pp) && i != mesh_ep_index) {
      stage = (stage == dynamic || facts.degree[i] == dynamic) ? static_cast<long long>(dynamic)
                                                               : stage * facts.degree[i];
    }
  }
  facts.ep_for_rule = facts.of(mesh_dim::ep);
  facts.stage_for_rule = stage;
  return facts;
}

template <class... Elems>
inline constexpr mesh_facts mesh_facts_v = make_mesh_facts<Elems...>();

// The compile-time rules, as variable templates so that a failure shows the numbers
// ("'mesh_degrees_multiply_to_world<16, 8>' evaluates to false").
template <long long Product, int World>
inline constexpr bool mesh_degrees_multiply_to_world = World == dynamic || Product == World;
template <long long StaticProduct, int World>
inline constexpr bool mesh_static_degrees_divide_world =
    World == dynamic || World % StaticProduct == 0;
template <int Ep, long long Stage>
inline constexpr bool mesh_ep_divides_stage = Ep == dynamic || Stage == dynamic || Stage % Ep == 0;

/// A mesh's degrees and world after compile-time inference (values or d9d::dynamic), and the
/// degrees the configuration gives (indexed by mesh_dim).
struct mesh_spec {
  int degree[mesh_dim_count] = {1, 1, 1, 1, 1, 1, 1};
  int world = dynamic;
};
struct mesh_given {
  std::optional<int> degree[mesh_dim_count];
};

inline constexpr int MeshShape::*mesh_shape_fields[mesh_dim_count] = {
    &MeshShape::pp,       &MeshShape::dp_replicate, &MeshShape::dp_shard, &MeshShape::cp_replicate,
    &MeshShape::cp_shard, &MeshShape::tp,           &MeshShape::ep};

/// d9d::resolve_mesh without the type: static degrees from `spec`, dynamic ones from `given`, at
/// most one left to infer from `world_size`; then MeshShape::check. Pure (the same on every rank).
inline MeshShape resolve_mesh_spec(const mesh_spec& spec, int world_size, const mesh_given& given) {
  const auto fail = [](const std::string& message) {
    throw std::invalid_argument("d9d::mesh: " + message);
  };
  const auto str = [](long long value) { return std::to_string(value); };
  if (world_size < 1) {
    fail("world size = " + str(world_size) + ", but a job has at least one rank. Fix: launch " +
         "with WORLD_SIZE >= 1");
  }
  if (spec.world != dynamic && spec.world != world_size) {
    fail("the plan's mesh declares d9d::world<" + str(spec.world) + ">, but the job has " +
         str(world_size) + " ranks. Fix: launch " + str(spec.world) +
         " ranks, or declare d9d::world<" + str(world_size) +
         "> (or d9d::world<d9d::dynamic>) in the mesh");
  }

  MeshShape shape;
  int missing[mesh_dim_count] = {};
  int missing_count = 0;
  for (int i = 0; i < mesh_dim_count; ++i) {
    const std::string name = mesh_dim_names[i];
    const std::optional<int>& value = given.degree[i];
    if (spec.degree[i] != dynamic) {
      if (value && *value != spec.degree[i]) {
        fail(name + " = " + str(*value) + " in the config contradicts the plan's mesh, which " +
             "fixes " + name + " = " + str(spec.degree[i]) + " at compile time. Fix: remove " +
             name + " from the config, or declare d9d::" + name +
             "<d9d::dynamic> in the mesh to take it from the config");
      }
      shape.*mesh_shape_fields[i] = spec.degree[i];
    } else if (value) {
      if (*value < 1) {
        fail(name + " = " + str(*value) + " is not a degree; every degree must be >= 1 (1 = " +
             "not parallel along it). Fix: set " + name + " >= 1 in the config, or leave it " +
             "out to infer it from the world size (when it is the only one left out)");
      }
      shape.*mesh_shape_fields[i] = *value;
    } else {
      missing[missing_count++] = i;
    }
  }

  if (missing_count > 0 && missing[missing_count - 1] == mesh_ep_index) {
    fail("ep is d9d::dynamic and not in the config; it cannot be inferred from the world size, " +
         std::string("which it does not multiply into. Fix: set ep in the config to a divisor ") +
         "of dp_replicate * dp_shard * cp_replicate * cp_shard * tp");
  }
  if (missing_count > 1) {
    std::string names;
    for (int k = 0; k < missing_count; ++k) {
      names += std::string(k == 0 ? "" : ", ") + mesh_dim_names[missing[k]];
    }
    fail(names + " are d9d::dynamic and not in the config; only one degree can be inferred " +
         "from the world size. Fix: set all but one of " + names + " in the config");
  }
  if (missing_count == 1) {
    const int at = missing[0];
    long long others = 1;
    bool more = false;  // the product already exceeds the world (stop before it can overflow)
    std::string factors;
    for (int i = 0; i < mesh_dim_count; ++i) {
      if (i == at || i == mesh_ep_index) {
        continue;
      }
      factors += std::string(factors.empty() ? "" : " * ") + mesh_dim_names[i];
      if (!more) {
        others *= shape.*mesh_shape_fields[i];
        more = others > world_size;
      }
    }
    if (more || world_size % others != 0) {
      fail(std::string("cannot infer ") + mesh_dim_names[at] + " from the world size: the job " +
           "has " + str(world_size) + " ranks, which is not a multiple of " + factors + " = " +
           (more ? "more than " + str(world_size) : str(others)) + ". Fix: launch a multiple " +
           "of that many ranks, or set the degrees in the config so that they divide " +
           str(world_size));
    }
    shape.*mesh_shape_fields[at] = static_cast<int>(world_size / others);
  }
  // Degrees from the config that do not multiply to the world: name the keys and the fix (the
  // generic message of MeshShape::check would suggest d9d::dynamic, which they already are).
  if (shape.world_size() != world_size) {
    std::string keys;
    int from_config = 0;
    int last = 0;
    for (int i = 0; i < mesh_dim_count; ++i) {
      if (i != mesh_ep_index && spec.degree[i] == dynamic && given.degree[i]) {
        keys += std::string(keys.empty() ? "" : ", ") + "\"mesh." + mesh_dim_names[i] +
                "\" = " + str(*given.degree[i]);
        ++from_config;
        last = i;
      }
    }
    if (from_config > 0) {
      std::string fix;
      if (from_config == 1) {
        const std::string key = std::string("\"mesh.") + mesh_dim_names[last] + "\"";
        const long long others = shape.world_size() / (shape.*mesh_shape_fields[last]);
        fix = (world_size % others == 0
                   ? "set " + key + " to " + str(world_size / others) + ", or remove it from the "
                   : "remove " + key + " from the ") +
              "config to infer it from the world size, or launch " + str(shape.world_size()) +
              " ranks";
      } else {
        fix = "set them so that the product is " + str(world_size) +
              ", or remove one of them from the config to infer it from the world size";
      }
      fail("pp * dp_replicate * dp_shard * cp_replicate * cp_shard * tp = " + shape.describe() +
           " = " + str(shape.world_size()) + " ranks, but the world has " + str(world_size) +
           "; the config sets " + keys + ". Fix: " + fix);
    }
  }
  shape.check(world_size);
  return shape;
}

template <class T>
inline constexpr bool is_mesh_v = false;
template <class... Elems>
inline constexpr bool is_mesh_v<mesh<Elems...>> = true;

/// The d9d::world<N> a mesh declares (d9d::dynamic when it declares none).
template <class Mesh>
inline constexpr int mesh_declared_world = dynamic;
template <class... Elems>
inline constexpr int mesh_declared_world<mesh<Elems...>> = mesh_facts_v<Elems...>.declared_world;

}  // namespace d9d::detail
