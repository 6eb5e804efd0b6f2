// d9d/core/device_mesh.cpp — domain layouts, coordinates and per-dimension process groups.
#include <algorithm>
#include <stdexcept>

#include <d9d/core/device_mesh.hpp>

namespace d9d {

std::string_view to_string(MeshDomain domain) {
  switch (domain) {
    case MeshDomain::regular:
      return "regular";
    case MeshDomain::dense:
      return "dense";
    case MeshDomain::expert:
      return "expert";
    case MeshDomain::batch:
      return "batch";
    case MeshDomain::flat:
      return "flat";
  }
  return "unknown";
}

std::vector<MeshDim> DeviceMesh::layout(const MeshShape& s, MeshDomain domain) {
  switch (domain) {
    case MeshDomain::regular:
      return {{"pp", s.pp},
              {"dp_replicate", s.dp_replicate},
              {"dp_shard", s.dp_shard},
              {"cp_shard", s.cp_shard},
              {"cp_replicate", s.cp_replicate},
              {"tp", s.tp}};
    case MeshDomain::dense:
      return {{"pp", s.pp},
              {"dp_replicate", s.dp_replicate},
              {"dp_cp_shard", s.dp_shard * s.cp_shard},
              {"cp_replicate", s.cp_replicate},
              {"tp", s.tp}};
    case MeshDomain::expert: {
      // The replicas of HSDP (dp_replicate, outermost in a stage) stay a dimension of their own
      // when the expert groups fit inside one replica; otherwise the groups span replicas.
      const auto stage = static_cast<int>(s.stage_size());
      const int replicas = (stage / s.dp_replicate) % s.ep == 0 ? s.dp_replicate : 1;
      return {{"pp", s.pp},
              {"ep_dp_replicate", replicas},
              {"ep_replicate", stage / (replicas * s.ep)},
              {"ep_shard", s.ep}};
    }
    case MeshDomain::batch:
      return {{"pp", s.pp},
              {"dp", s.dp_replicate * s.dp_shard},
              {"cp", s.cp_shard * s.cp_replicate},
              {"tp", s.tp}};
    case MeshDomain::flat:
      return {{"world", static_cast<int>(s.world_size())}};
  }
  throw std::invalid_argument("d9d::DeviceMesh: unknown domain");
}

namespace {

std::size_t dim_index(const std::vector<MeshDim>& dims, MeshDomain domain, std::string_view name) {
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i].name == name) {
      return i;
    }
  }
  std::string known;
  for (const auto& dim : dims) {
    known += (known.empty() ? "" : ", ") + dim.name;
  }
  throw std::invalid_argument("d9d::DeviceMesh: the " + std::string(to_string(domain)) +
                              " domain has no dimension \"" + std::string(name) +
                              "\"; its dimensions are " + known);
}

int ravel(const std::vector<MeshDim>& dims, const std::vector<int>& coords) {
  int rank = 0;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    rank = rank * dims[i].size + coords[i];
  }
  return rank;
}

}  // namespace

std::vector<int> DeviceMesh::coordinates_of(const MeshShape& shape, MeshDomain domain, int rank) {
  const auto dims = layout(shape, domain);
  if (rank < 0 || rank >= shape.world_size()) {
    throw std::invalid_argument("d9d::DeviceMesh: rank " + std::to_string(rank) +
                                " is outside the mesh of " + std::to_string(shape.world_size()) +
                                " ranks");
  }
  std::vector<int> coords(dims.size());
  for (std::size_t i = dims.size(); i-- > 0;) {
    coords[i] = rank % dims[i].size;
    rank /= dims[i].size;
  }
  return coords;
}

std::vector<int> DeviceMesh::group_ranks_of(const MeshShape& shape, MeshDomain domain,
                                            const std::vector<std::string>& names, int rank) {
  const auto dims = layout(shape, domain);
  std::vector<bool> selected(dims.size(), false);
  for (const auto& name : names) {
    selected[dim_index(dims, domain, name)] = true;
  }
  auto coords = coordinates_of(shape, domain, rank);
  std::vector<std::size_t> axes;
  int count = 1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (selected[i]) {
      axes.push_back(i);
      coords[i] = 0;
      count *= dims[i].size;
    }
  }
  std::vector<int> ranks;
  ranks.reserve(static_cast<std::size_t>(count));
  for (int index = 0; index < count; ++index) {
    int rest = index;
    for (std::size_t a = axes.size(); a-- > 0;) {
      coords[axes[a]] = rest % dims[axes[a]].size;
      rest /= dims[axes[a]].size;
    }
    ranks.push_back(ravel(dims, coords));
  }
  return ranks;
}

DeviceMesh::DeviceMesh(DistributedContext context, MeshShape shape)
    : context_(std::move(context)), shape_(shape) {
  shape_.check(context_.world_size());
  // Every single-dimension group of every domain, in the same order on every rank: each step is a
  // partition of the ranks, so each rank joins exactly one group per step and nothing deadlocks.
  for (const auto domain : {MeshDomain::regular, MeshDomain::dense, MeshDomain::expert,
                            MeshDomain::batch, MeshDomain::flat}) {
    for (const auto& dim : layout(shape_, domain)) {
      (void)group(domain, dim.name);
    }
  }
  context_.logger().set_coordinates(describe_coordinates());
  context_.barrier();  // all groups are connected everywhere before any rank moves on
}

int DeviceMesh::size(MeshDomain domain, std::string_view dim) const {
  const auto dims = layout(shape_, domain);
  return dims[dim_index(dims, domain, dim)].size;
}

int DeviceMesh::coordinate(MeshDomain domain, std::string_view dim) const {
  const auto dims = layout(shape_, domain);
  return coordinates(domain)[dim_index(dims, domain, dim)];
}

std::vector<int> DeviceMesh::coordinates(MeshDomain domain) const {
  return coordinates_of(shape_, domain, context_.rank());
}

ProcessGroup DeviceMesh::group(MeshDomain domain, std::string_view dim) const {
  return group(domain, std::vector<std::string>{std::string(dim)});
}

ProcessGroup DeviceMesh::group(MeshDomain domain, const std::vector<std::string>& dims) const {
  std::string name = std::string(to_string(domain)) + "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    name += (i == 0 ? "" : ",") + dims[i];
  }
  name += "]";
  return context_.group(group_ranks_of(shape_, domain, dims, context_.rank()), name);
}

std::string DeviceMesh::describe_coordinates() const {
  const auto dims = layout(shape_, MeshDomain::regular);
  const auto coords = coordinates(MeshDomain::regular);
  std::string out;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i].size > 1) {
      out += (out.empty() ? "" : " ") + dims[i].name + "=" + std::to_string(coords[i]);
    }
  }
  return out.empty() ? "single rank" : out;
}

}  // namespace d9d
