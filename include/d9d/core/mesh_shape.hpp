// d9d/core/mesh_shape.hpp — the parallelism degrees of a device mesh, resolved to numbers.
//
//   d9d::MeshShape shape{.dp_shard = 4, .tp = 2};
//   shape.check(/*world_size=*/8);            // throws std::invalid_argument naming the problem
//   auto mesh = d9d::DeviceMesh(ctx, shape);  // (core/device_mesh.hpp)
//
// A plain aggregate: the Plan's d9d::mesh<...> resolves to one at start-up (static degrees from the
// type, d9d::dynamic ones from the config or the world size), and the DeviceMesh is built from it.
#pragma once

#include <stdexcept>
#include <string>

namespace d9d {

/// Degrees of the named mesh dimensions (each >= 1).
struct MeshShape {
  int pp = 1;
  int dp_replicate = 1;
  int dp_shard = 1;
  int cp_replicate = 1;
  int cp_shard = 1;
  int tp = 1;
  int ep = 1;

  /// Ranks one pipeline stage spans: dp_replicate * dp_shard * cp_replicate * cp_shard * tp.
  [[nodiscard]] constexpr long long stage_size() const {
    return 1LL * dp_replicate * dp_shard * cp_replicate * cp_shard * tp;
  }
  /// Ranks the whole mesh spans: pp * stage_size().
  [[nodiscard]] constexpr long long world_size() const { return pp * stage_size(); }

  /// Empty when this shape fits `world` ranks; else a message naming the degree, the value and a
  /// fix.
  [[nodiscard]] std::string validate(int world) const {
    const struct {
      const char* name;
      int value;
    } degrees[] = {{"pp", pp},
                   {"dp_replicate", dp_replicate},
                   {"dp_shard", dp_shard},
                   {"cp_replicate", cp_replicate},
                   {"cp_shard", cp_shard},
                   {"tp", tp},
                   {"ep", ep}};
    for (const auto& degree : degrees) {
      if (degree.value < 1) {
        return std::string("d9d::mesh: ") + degree.name + " = " + std::to_string(degree.value) +
               " is not a degree; every degree must be >= 1 (1 = not parallel along it)";
      }
    }
    if (world_size() != world) {
      return "d9d::mesh: pp * dp_replicate * dp_shard * cp_replicate * cp_shard * tp = " +
             describe() + " = " + std::to_string(world_size()) + " ranks, but the world has " +
             std::to_string(world) + ". Fix: choose degrees whose product is " +
             std::to_string(world) + ", or make one degree d9d::dynamic";
    }
    if (stage_size() % ep != 0) {
      return "d9d::mesh: ep = " + std::to_string(ep) +
             " must divide dp_replicate * dp_shard * cp_replicate * cp_shard * tp = " +
             std::to_string(stage_size()) + ". Fix: pick ep among the divisors of " +
             std::to_string(stage_size());
    }
    return {};
  }

  /// Throws std::invalid_argument with validate()'s message unless the shape fits `world` ranks.
  void check(int world) const {
    if (auto message = validate(world); !message.empty()) {
      throw std::invalid_argument(message);
    }
  }

  /// "(pp=1 dp_replicate=1 dp_shard=4 ... ep=1)": every degree by name.
  [[nodiscard]] std::string describe() const {
    return "(pp=" + std::to_string(pp) + " dp_replicate=" + std::to_string(dp_replicate) +
           " dp_shard=" + std::to_string(dp_shard) +
           " cp_replicate=" + std::to_string(cp_replicate) +
           " cp_shard=" + std::to_string(cp_shard) + " tp=" + std::to_string(tp) +
           " ep=" + std::to_string(ep) + ")";
  }

  bool operator==(const MeshShape&) const = default;
};

}  // namespace d9d
