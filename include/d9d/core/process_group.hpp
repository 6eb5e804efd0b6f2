// d9d/core/process_group.hpp — a handle to a group of ranks that communicate together.
//
//   d9d::ProcessGroup group = mesh.group(d9d::MeshDomain::regular, "dp_shard");
//   at::Tensor sum = d9d::all_reduce(group, grad);        // core/collectives.hpp
//   group.size(); group.rank(); group.ranks();             // members, this rank's index
//
// Copies share the same group. A group of one rank has no backend: collectives on it are local.
// The c10d backend (Gloo on CPU, NCCL on GPU) stays out of this header.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace d9d {

/// A set of ranks with a communication backend (shared handle; cheap to copy).
class ProcessGroup {
 public:
  struct Impl;

  ProcessGroup() = default;
  explicit ProcessGroup(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

  /// Number of member ranks (0 for a default-constructed handle).
  [[nodiscard]] int size() const;
  /// This process's index among the members.
  [[nodiscard]] int rank() const;
  /// Global ranks of the members, in group order.
  [[nodiscard]] const std::vector<int>& ranks() const;
  /// Where tensors for this group's collectives live (cpu for Gloo, cuda:i for NCCL).
  [[nodiscard]] c10::Device device() const;
  /// The c10d backend; null when size() <= 1.
  [[nodiscard]] c10d::Backend* backend() const;
  /// The store the members met through (keys private to this group); null when size() <= 1.
  [[nodiscard]] c10d::Store* store() const;
  /// A readable name, e.g. "regular[dp_shard]" or "world".
  [[nodiscard]] const std::string& name() const;
  /// Blocks until every member reached it (no-op for one rank).
  void barrier() const;
  [[nodiscard]] bool valid() const { return impl_ != nullptr; }

 private:
  [[nodiscard]] const Impl& impl() const;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace d9d
