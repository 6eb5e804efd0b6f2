// d9d/core/device_mesh.hpp — the ranks of a job as named dimensions, in five views (domains).
//
//   d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_shard = 4, .tp = 2});
//   mesh.coordinate(d9d::MeshDomain::regular, "tp");               // this rank's tp index
//   d9d::ProcessGroup dp = mesh.group(d9d::MeshDomain::batch, "dp"); // all-reduce gradients here
//
// Every domain is a row-major layout of the same world ranks, outer to inner:
//   regular: pp, dp_replicate, dp_shard, cp_shard, cp_replicate, tp
//   dense:   pp, dp_replicate, dp_cp_shard (= dp_shard*cp_shard), cp_replicate, tp
//   expert:  pp, ep_dp_replicate (= dp_replicate), ep_replicate (= the rest of a stage / ep),
//            ep_shard (= ep); when ep does not divide a replica's ranks (stage / dp_replicate):
//            ep_dp_replicate = 1, ep_replicate = stage / ep
//   batch:   pp, dp (= dp_replicate*dp_shard), cp (= cp_shard*cp_replicate), tp
//   flat:    world
// so a rank has one coordinate per dimension of each domain. The ranks holding the same experts
// are those of ep_dp_replicate x ep_replicate (HSDP's replicas, and within one replica the ranks
// FullyShard shards the experts over). Building the mesh checks the shape against the world (the
// same clear error on every rank, before any communication) and creates, in one fixed order on
// every rank, the process group of every single dimension of every domain (identical rank sets
// share one group). Groups over several dimensions are made on first request.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <d9d/core/distributed_context.hpp>
#include <d9d/core/mesh_shape.hpp>
#include <d9d/core/process_group.hpp>

namespace d9d {

/// The five views of the mesh.
enum class MeshDomain { regular, dense, expert, batch, flat };

/// "regular", "dense", "expert", "batch" or "flat".
[[nodiscard]] std::string_view to_string(MeshDomain domain);

/// One named dimension of a domain.
struct MeshDim {
  std::string name;
  int size = 1;
  bool operator==(const MeshDim&) const = default;
};

/// Named-dimension views of the ranks, with their process groups.
class DeviceMesh {
 public:
  /// Checks `shape` against the context's world size (std::invalid_argument on mismatch) and
  /// creates the per-dimension process groups.
  DeviceMesh(DistributedContext context, MeshShape shape);

  /// The dimensions of `domain`, outer to inner (a pure function of the shape).
  [[nodiscard]] static std::vector<MeshDim> layout(const MeshShape& shape, MeshDomain domain);
  /// The coordinates of global rank `rank` in `domain` (one per dimension of layout()).
  [[nodiscard]] static std::vector<int> coordinates_of(const MeshShape& shape, MeshDomain domain,
                                                       int rank);
  /// The global ranks sharing `rank`'s coordinates outside `dims`, row-major over `dims` (taken in
  /// the domain's order): the members of `rank`'s group along `dims`.
  [[nodiscard]] static std::vector<int> group_ranks_of(const MeshShape& shape, MeshDomain domain,
                                                       const std::vector<std::string>& dims,
                                                       int rank);

  [[nodiscard]] const MeshShape& shape() const { return shape_; }
  [[nodiscard]] const DistributedContext& context() const { return context_; }
  [[nodiscard]] std::vector<MeshDim> dims(MeshDomain domain) const {
    return layout(shape_, domain);
  }
  /// Size of one dimension; std::invalid_argument listing the domain's dimensions if unknown.
  [[nodiscard]] int size(MeshDomain domain, std::string_view dim) const;
  /// This rank's coordinate along one dimension (its rank within that dimension's group).
  [[nodiscard]] int coordinate(MeshDomain domain, std::string_view dim) const;
  /// This rank's coordinates in `domain`.
  [[nodiscard]] std::vector<int> coordinates(MeshDomain domain) const;
  /// This rank's group along one dimension (created with the mesh).
  [[nodiscard]] ProcessGroup group(MeshDomain domain, std::string_view dim) const;
  /// This rank's group along several dimensions of one domain (created on first request:
  /// collective over its members, so request such groups in the same order on every rank).
  [[nodiscard]] ProcessGroup group(MeshDomain domain, const std::vector<std::string>& dims) const;
  /// "pp=0 dp_replicate=0 dp_shard=1 cp_shard=0 cp_replicate=0 tp=1" (regular coordinates).
  [[nodiscard]] std::string describe_coordinates() const;

 private:
  DistributedContext context_;
  MeshShape shape_;
};

}  // namespace d9d
