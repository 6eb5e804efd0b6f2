// d9d/parallel/strategy.cpp — what strategies contribute to the data and the loss
// (d9d/parallel/strategy.hpp), and data parallelism's contribution.
#include <string>
#include <vector>

#include <d9d/core/device_mesh.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/parallel/strategy.hpp>

namespace d9d::parallel {

namespace {

StepContributions::Share share_over(const DeviceMesh& mesh, const std::vector<std::string>& dims) {
  StepContributions::Share share;
  for (const auto& dim : dims) {
    const int size = mesh.size(MeshDomain::batch, dim);
    share.index = share.index * size + mesh.coordinate(MeshDomain::batch, dim);
    share.count *= size;
  }
  return share;
}

}  // namespace

StepContributions::Share StepContributions::samples(const DeviceMesh& mesh) const {
  return share_over(mesh, sample_dims);
}

StepContributions::Share StepContributions::sequence_part(const DeviceMesh& mesh) const {
  return share_over(mesh, sequence_dims);
}

std::vector<ProcessGroup> StepContributions::loss_groups(const DeviceMesh& mesh) const {
  std::vector<ProcessGroup> out;
  out.reserve(loss_dims.size());
  for (const auto& dim : loss_dims) {
    out.push_back(mesh.group(MeshDomain::batch, dim));
  }
  return out;
}

at::Tensor StepContributions::shard(const std::string& path, const at::Tensor& tensor) const {
  at::Tensor out = tensor;
  for (const auto& sharding : microbatch) {
    out = sharding(path, out);
  }
  return out;
}

namespace detail {

void contribute_data_parallel(StepContributions& contributions) {
  contributions.sample_dims.emplace_back("dp");
  contributions.loss_dims.emplace_back("dp");
}

}  // namespace detail

}  // namespace d9d::parallel
