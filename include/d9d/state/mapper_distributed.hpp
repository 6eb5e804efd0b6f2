// d9d/state/mapper_distributed.hpp — state mapper leaves between full tensors and the shards of a
// device mesh (d9d::ShardedTensor).
//
//   namespace st = d9d::state;
//   const st::ShardLayout rows{.mesh = mesh, .dims = {"dp_shard"}, .placements = {d9d::Shard{0}}};
//   auto m = st::sequential({st::rename("hf.w", "w"), st::distribute({"w"}, rows)});
//   st::load_into(model, source, m);  // every rank reads and copies only its rows of "w"
//
// distribute: a full tensor in, this rank's local shard out, with no communication (the full
// tensor is the same on every rank: it comes from the checkpoint). In a stream the full tensor is
// a view of the mapped file, so only the shard's bytes are copied. gather_full: the inverse, a
// collective over the mesh dimensions — every rank must apply the same groups in the same order,
// which a stream does (its plan depends only on the source and the mapper); do not combine
// gather_full with shard(). Header-only on purpose: these leaves need //:d9d (the core), which the
// state library does not depend on.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/mapper.hpp>

namespace d9d::state {

/// Where the shards of a tensor live: as the arguments of ShardedTensor::distribute.
struct ShardLayout {
  DeviceMesh mesh;
  MeshDomain domain = MeshDomain::regular;
  /// Mesh dimensions of `domain`, one placement each.
  std::vector<std::string> dims;
  std::vector<Placement> placements;
};

namespace detail {

/// "distribute(regular: dp_shard=Shard(0))"-style description of a layout.
inline std::string layout_name(std::string_view op, const ShardLayout& layout) {
  std::string out = std::string(op) + "(" + std::string(to_string(layout.domain)) + ":";
  for (std::size_t i = 0; i < layout.dims.size(); ++i) {
    out += " " + layout.dims[i] + "=" +
           (i < layout.placements.size() ? to_string(layout.placements[i]) : std::string("?"));
  }
  return out + ")";
}

}  // namespace detail

/// Each key: the full tensor in, this rank's local shard under `layout` out (the local() of
/// ShardedTensor::distribute; no communication). Uneven splits follow d9d::shard_range. Errors of
/// ShardedTensor::distribute (a placement count that does not match the dims, a tensor dimension
/// out of range) come out of apply as they are.
[[nodiscard]] inline Mapper distribute(const std::vector<std::string>& keys,
                                       const ShardLayout& layout) {
  std::vector<Mapper> parts;
  parts.reserve(keys.size());
  const std::string op = detail::layout_name("distribute", layout);
  for (const auto& key : keys) {
    parts.push_back(leaf(
        op, {key}, {key},
        [key, layout](TensorMap in) {
          TensorMap out;
          out.emplace(key, ShardedTensor::distribute(in.at(key), layout.mesh, layout.domain,
                                                     layout.dims, layout.placements)
                               .local());
          return out;
        },
        /*runs_on_meta=*/true));
  }
  return parallel(parts);
}

/// Each key: this rank's local shard under `layout` in, the full tensor of shape
/// `global_shapes.at(key)` out (ShardedTensor::full_tensor: a collective over the layout's mesh
/// dimensions). One entry of `global_shapes` per key; the keys are those of the map.
[[nodiscard]] inline Mapper gather_full(
    const std::map<std::string, std::vector<int64_t>>& global_shapes, const ShardLayout& layout) {
  std::vector<Mapper> parts;
  parts.reserve(global_shapes.size());
  const std::string op = detail::layout_name("gather_full", layout);
  for (const auto& [key, shape] : global_shapes) {
    parts.push_back(leaf(op, {key}, {key}, [key = key, shape = shape, layout](TensorMap in) {
      const ShardedTensor sharded(in.at(key), layout.mesh, layout.domain, layout.dims,
                                  layout.placements, shape);
      TensorMap out;
      out.emplace(key, sharded.full_tensor());
      return out;
    }));
  }
  return parallel(parts);
}

}  // namespace d9d::state
