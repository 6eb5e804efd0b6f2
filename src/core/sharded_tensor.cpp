// d9d/core/sharded_tensor.cpp — placements, uneven shard ranges and redistribution.
#include <stdexcept>

#include <ATen/ATen.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/sharded_tensor.hpp>

namespace d9d {

std::string to_string(const Placement& placement) {
  if (const auto* shard = std::get_if<Shard>(&placement)) {
    return "Shard(" + std::to_string(shard->dim) + ")";
  }
  return std::holds_alternative<Replicate>(placement) ? "Replicate()" : "Partial(sum)";
}

ShardRange shard_range(int64_t size, int shards, int index) {
  if (shards < 1 || index < 0 || index >= shards || size < 0) {
    throw std::invalid_argument("d9d::shard_range: bad arguments (size " + std::to_string(size) +
                                ", shards " + std::to_string(shards) + ", index " +
                                std::to_string(index) + ")");
  }
  const int64_t chunk = (size + shards - 1) / shards;
  const int64_t offset = std::min(size, chunk * index);
  return {.offset = offset, .length = std::min(chunk, size - offset)};
}

namespace {

struct Step {
  ProcessGroup group;
  int size = 1;
  int coordinate = 0;
};

std::vector<Step> steps_of(const DeviceMesh& mesh, MeshDomain domain,
                           const std::vector<std::string>& dims) {
  std::vector<Step> steps;
  steps.reserve(dims.size());
  for (const auto& dim : dims) {
    steps.push_back({.group = mesh.group(domain, dim),
                     .size = mesh.size(domain, dim),
                     .coordinate = mesh.coordinate(domain, dim)});
  }
  return steps;
}

int64_t shard_dim(const Placement& placement) {
  const auto* shard = std::get_if<Shard>(&placement);
  return shard == nullptr ? -1 : shard->dim;
}

// True when some tensor dimension is sharded by more than one mesh dimension.
bool nested(const std::vector<Placement>& placements) {
  for (std::size_t i = 0; i < placements.size(); ++i) {
    for (std::size_t j = i + 1; j < placements.size(); ++j) {
      if (shard_dim(placements[i]) >= 0 && shard_dim(placements[i]) == shard_dim(placements[j])) {
        return true;
      }
    }
  }
  return false;
}

// One mesh dimension from Replicate to `target` (Shard narrows the current extent: nests).
at::Tensor apply_from_replicate(const at::Tensor& local, const Placement& target,
                                const Step& step) {
  if (const auto d = shard_dim(target); d >= 0) {
    const auto range = shard_range(local.size(d), step.size, step.coordinate);
    return local.narrow(d, range.offset, range.length).contiguous();
  }
  if (std::holds_alternative<Partial>(target)) {
    return step.coordinate == 0 ? local : at::zeros_like(local);
  }
  return local;
}

// One mesh dimension from `source` to Replicate.
at::Tensor to_replicate(const at::Tensor& local, const Placement& source, const Step& step) {
  if (const auto d = shard_dim(source); d >= 0) {
    return at::cat(all_gather_varying(step.group, local), d);
  }
  if (std::holds_alternative<Partial>(source)) {
    return all_reduce(step.group, local);
  }
  return local;
}

void check_placements(const std::vector<Placement>& placements, std::size_t dims,
                      std::size_t rank) {
  if (placements.size() != dims) {
    throw std::invalid_argument("d9d::ShardedTensor: " + std::to_string(placements.size()) +
                                " placements for " + std::to_string(dims) +
                                " mesh dimensions; give one per mesh dimension");
  }
  for (const auto& placement : placements) {
    const auto d = shard_dim(placement);
    if (std::holds_alternative<Shard>(placement) && (d < 0 || d >= static_cast<int64_t>(rank))) {
      throw std::invalid_argument("d9d::ShardedTensor: " + to_string(placement) +
                                  " does not name a dimension of a " + std::to_string(rank) +
                                  "-dimensional tensor");
    }
  }
}

}  // namespace

ShardedTensor::ShardedTensor(at::Tensor local, DeviceMesh mesh, MeshDomain domain,
                             std::vector<std::string> dims, std::vector<Placement> placements,
                             std::vector<int64_t> global_shape)
    : local_(std::move(local)),
      mesh_(std::move(mesh)),
      domain_(domain),
      dims_(std::move(dims)),
      placements_(std::move(placements)),
      global_shape_(std::move(global_shape)) {
  check_placements(placements_, dims_.size(), global_shape_.size());
  const auto ranges = local_ranges();
  for (std::size_t d = 0; d < ranges.size(); ++d) {
    if (local_.dim() != static_cast<int64_t>(global_shape_.size()) ||
        local_.size(static_cast<int64_t>(d)) != ranges[d].length) {
      throw std::invalid_argument("d9d::ShardedTensor: local shape " + c10::str(local_.sizes()) +
                                  " does not match this rank's shard " + "of the global shape " +
                                  c10::str(c10::IntArrayRef(global_shape_)));
    }
  }
}

ShardedTensor ShardedTensor::distribute(const at::Tensor& full, const DeviceMesh& mesh,
                                        MeshDomain domain, std::vector<std::string> dims,
                                        std::vector<Placement> placements) {
  check_placements(placements, dims.size(), static_cast<std::size_t>(full.dim()));
  const auto steps = steps_of(mesh, domain, dims);
  at::Tensor local = full;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    local = apply_from_replicate(local, placements[i], steps[i]);
  }
  return {local.contiguous(), mesh, domain, std::move(dims), std::move(placements),
          full.sizes().vec()};
}

std::vector<ShardRange> ShardedTensor::local_ranges() const {
  std::vector<ShardRange> ranges;
  ranges.reserve(global_shape_.size());
  for (const auto size : global_shape_) {
    ranges.push_back({.offset = 0, .length = size});
  }
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (const auto d = shard_dim(placements_[i]); d >= 0) {
      auto& range = ranges[static_cast<std::size_t>(d)];
      const auto part = shard_range(range.length, mesh_.size(domain_, dims_[i]),
                                    mesh_.coordinate(domain_, dims_[i]));
      range = {.offset = range.offset + part.offset, .length = part.length};
    }
  }
  return ranges;
}

ShardedTensor ShardedTensor::redistribute(const std::vector<Placement>& target) const {
  check_placements(target, dims_.size(), global_shape_.size());
  const auto steps = steps_of(mesh_, domain_, dims_);
  at::Tensor local = local_;
  if (nested(placements_) || nested(target)) {
    // General path: back to a full copy (innermost mesh dimension first), then lay out again.
    for (std::size_t i = steps.size(); i-- > 0;) {
      local = to_replicate(local, placements_[i], steps[i]);
    }
    for (std::size_t i = 0; i < steps.size(); ++i) {
      local = apply_from_replicate(local, target[i], steps[i]);
    }
  } else {
    // No tensor dimension is split twice, so each mesh dimension changes on its own: first undo
    // the shards that change, then apply the new placements (a reduction happens once, where a
    // Partial dimension becomes something else).
    std::vector<Placement> state = placements_;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (std::holds_alternative<Shard>(state[i]) && state[i] != target[i]) {
        local = to_replicate(local, state[i], steps[i]);
        state[i] = Replicate{};
      }
    }
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (state[i] == target[i]) {
        continue;
      }
      if (std::holds_alternative<Partial>(state[i])) {
        local = all_reduce(steps[i].group, local);
      }
      local = apply_from_replicate(local, target[i], steps[i]);
    }
  }
  return {local.contiguous(), mesh_, domain_, dims_, target, global_shape_};
}

at::Tensor ShardedTensor::full_tensor() const {
  return redistribute(std::vector<Placement>(dims_.size(), Replicate{})).local();
}

}  // namespace d9d
