// d9d/core/sharded_tensor.hpp — a tensor split over mesh dimensions (the DTensor idea in C++).
//
//   auto w = d9d::ShardedTensor::distribute(full, mesh, d9d::MeshDomain::regular, {"dp_shard"},
//                                           {d9d::Shard{0}});           // rows split over dp_shard
//   at::Tensor again = w.full_tensor();                                 // all-gathers the rows
//   auto r = w.redistribute({d9d::Replicate{}});                        // every rank holds all
//
// A ShardedTensor is this rank's local tensor plus where it sits: mesh dimensions (of one domain)
// and one placement per dimension — Shard{d} (split along tensor dim d), Replicate{} (a full copy)
// or Partial{} (a summand: the full value is the sum over that mesh dimension). Placements apply in
// mesh-dimension order, so two mesh dimensions sharding the same tensor dim nest (outer first).
// Uneven splits follow one rule everywhere (torch.chunk's): with n elements over k shards each
// shard has ceil(n/k), the last ones fewer, possibly none (see shard_range).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/device_mesh.hpp>

namespace d9d {

/// Split along tensor dimension `dim`.
struct Shard {
  int64_t dim = 0;
  bool operator==(const Shard&) const = default;
};
/// A full copy on every rank of the mesh dimension.
struct Replicate {
  bool operator==(const Replicate&) const = default;
};
/// A summand: the full value is the sum over the mesh dimension.
struct Partial {
  bool operator==(const Partial&) const = default;
};
using Placement = std::variant<Shard, Replicate, Partial>;

/// "Shard(0)", "Replicate()", "Partial(sum)".
[[nodiscard]] std::string to_string(const Placement& placement);

/// The part of a dimension of `size` elements that shard `index` of `shards` holds.
struct ShardRange {
  int64_t offset = 0;
  int64_t length = 0;
  bool operator==(const ShardRange&) const = default;
};
/// ceil(size / shards) per shard, the last ones shorter (possibly empty).
[[nodiscard]] ShardRange shard_range(int64_t size, int shards, int index);

/// This rank's part of a tensor spread over a device mesh.
class ShardedTensor {
 public:
  /// Wraps a local tensor already laid out as `placements` say (checked against global_shape).
  ShardedTensor(at::Tensor local, DeviceMesh mesh, MeshDomain domain, std::vector<std::string> dims,
                std::vector<Placement> placements, std::vector<int64_t> global_shape);

  /// Lays out `full` (the same on every rank) as `placements` say; no communication.
  [[nodiscard]] static ShardedTensor distribute(const at::Tensor& full, const DeviceMesh& mesh,
                                                MeshDomain domain, std::vector<std::string> dims,
                                                std::vector<Placement> placements);

  /// The same values under other placements (collective over the mesh dimensions involved).
  [[nodiscard]] ShardedTensor redistribute(const std::vector<Placement>& placements) const;
  /// The whole tensor on every rank (collective).
  [[nodiscard]] at::Tensor full_tensor() const;

  [[nodiscard]] const at::Tensor& local() const { return local_; }
  [[nodiscard]] const std::vector<int64_t>& global_shape() const { return global_shape_; }
  [[nodiscard]] const std::vector<Placement>& placements() const { return placements_; }
  [[nodiscard]] const std::vector<std::string>& dims() const { return dims_; }
  [[nodiscard]] MeshDomain domain() const { return domain_; }
  [[nodiscard]] const DeviceMesh& mesh() const { return mesh_; }
  /// This rank's (offset, length) in every tensor dimension of the global tensor.
  [[nodiscard]] std::vector<ShardRange> local_ranges() const;

 private:
  at::Tensor local_;
  DeviceMesh mesh_;
  MeshDomain domain_;
  std::vector<std::string> dims_;
  std::vector<Placement> placements_;
  std::vector<int64_t> global_shape_;
};

}  // namespace d9d
