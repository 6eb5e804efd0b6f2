// examples/02_mesh_domains — how a Plan's mesh lays out the ranks of a job, in the five domains.
//
//   tools/d9drun -n 8 bazel-bin/examples/02_mesh_domains/02_mesh_domains --dp-replicate 2 --tp 2
//
// Each rank resolves the plan's mesh against the real world size (degrees written as
// d9d::dynamic come from the flags; dp_shard is inferred from the world), builds the DeviceMesh,
// prints its coordinates and group members in every domain, and checks each group by an
// all-reduce of the members' ranks. A mesh that does not fit the world stops every rank with the
// same message.
#include <numeric>
#include <string>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/main.hpp>

// ---- configuration: one `using` per plan slot -------------------------------------------------
using Mesh =
    d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_replicate<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>,
              d9d::tp<d9d::dynamic>,
              d9d::ep<d9d::dynamic>>;  // or numbers: d9d::mesh<d9d::dp_shard<4>, d9d::tp<2>>
using DataParallel = d9d::parallel::Replicate;  // or d9d::parallel::Fsdp
using Precision = d9d::precision::Fp32;         // or d9d::precision::Bf16Mixed
using MyPlan = d9d::Plan<Mesh, DataParallel, Precision>;
// -----------------------------------------------------------------------------------------------

namespace {

int show(int argc, char** argv) {
  CLI::App app{"Print how the plan's mesh places this rank in every domain"};
  int pp = 1;
  int dp_replicate = 1;
  int tp = 1;
  int ep = 1;
  app.add_option("--pp", pp, "pipeline-parallel degree");
  app.add_option("--dp-replicate", dp_replicate, "data-parallel replicas");
  app.add_option("--tp", tp, "tensor-parallel degree");
  app.add_option("--ep", ep, "expert-parallel degree");
  CLI11_PARSE(app, argc, argv);

  const auto ctx = d9d::DistributedContext::from_env();
  d9d::MeshShape shape;
  try {
    shape = d9d::resolve_mesh<MyPlan::mesh>(
        ctx.world_size(), {.pp = pp, .dp_replicate = dp_replicate, .tp = tp, .ep = ep});
  } catch (const std::invalid_argument& error) {
    ctx.logger().error(error.what());
    return 2;
  }
  const d9d::DeviceMesh mesh(ctx, shape);
  ctx.logger().info_main("mesh " + shape.describe() + " on " + std::to_string(ctx.world_size()) +
                         " ranks, backend " + ctx.backend_name());

  int bad_groups = 0;
  for (const auto domain :
       {d9d::MeshDomain::regular, d9d::MeshDomain::dense, d9d::MeshDomain::expert,
        d9d::MeshDomain::batch, d9d::MeshDomain::flat}) {
    std::string line = std::string(d9d::to_string(domain)) + ":";
    for (const auto& dim : mesh.dims(domain)) {
      const auto group = mesh.group(domain, dim.name);
      line += " " + dim.name + "=" + std::to_string(mesh.coordinate(domain, dim.name)) + "/" +
              std::to_string(dim.size) + "{";
      for (std::size_t i = 0; i < group.ranks().size(); ++i) {
        line += (i == 0 ? "" : ",") + std::to_string(group.ranks()[i]);
      }
      line += "}";
      // The group's own view of its members: the sum of their ranks.
      const auto sum =
          d9d::all_reduce(group, at::scalar_tensor(ctx.rank(), at::kLong)).item<int64_t>();
      bad_groups += sum != std::accumulate(group.ranks().begin(), group.ranks().end(), int64_t{0});
    }
    ctx.logger().info(line);
  }
  ctx.barrier();
  if (bad_groups != 0) {
    ctx.logger().error(std::to_string(bad_groups) + " groups disagree with the mesh layout");
    return 1;
  }
  ctx.logger().info_main("every group checked");
  return 0;
}

}  // namespace

// Any other error is printed as one line per rank with exit status 1, never an abort.
int main(int argc, char** argv) { return d9d::run_main(argc, argv, show); }
