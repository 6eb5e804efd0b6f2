// Single-process tests of the distributed core: launch-environment parsing, mesh layouts and
// coordinates, shard and split ranges, batch trees, and local mode (world 1, no environment).
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <boost/hana/adapt_struct.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/core/object_collectives.hpp>
#include <d9d/core/sharded_tensor.hpp>

namespace core_test {

struct Batch {
  at::Tensor input_ids;
  at::Tensor labels;
  std::optional<at::Tensor> mask;
  std::map<std::string, at::Tensor> extra;
  std::vector<at::Tensor> images;
  std::tuple<at::Tensor, int> pair;
  int step = 0;
};

}  // namespace core_test

BOOST_HANA_ADAPT_STRUCT(core_test::Batch, input_ids, labels, mask, extra, images, pair, step);

namespace {

using d9d::MeshDomain;
using d9d::MeshShape;
using ::testing::HasSubstr;

// ------------------------------------------------------------------------------------------------
// Launch environment

std::function<std::optional<std::string>(std::string_view)> env_of(
    std::map<std::string, std::string> values) {
  return [values = std::move(values)](std::string_view name) -> std::optional<std::string> {
    auto found = values.find(std::string(name));
    return found == values.end() ? std::nullopt : std::optional<std::string>(found->second);
  };
}

std::string launch_error(std::map<std::string, std::string> values) {
  try {
    (void)d9d::parse_launch_env(env_of(std::move(values)));
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(Core_LaunchEnv, NothingSetMeansLocal) {
  const auto info = d9d::parse_launch_env(env_of({}));
  EXPECT_EQ(info.launcher, d9d::Launcher::local);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

TEST(Core_LaunchEnv, Torchrun) {
  const auto info = d9d::parse_launch_env(env_of({{"RANK", "5"},
                                                  {"WORLD_SIZE", "8"},
                                                  {"LOCAL_RANK", "1"},
                                                  {"LOCAL_WORLD_SIZE", "4"},
                                                  {"MASTER_ADDR", "node0"},
                                                  {"MASTER_PORT", "29500"},
                                                  {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(info.launcher, d9d::Launcher::torchrun);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "node0");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_TRUE(info.agent_store);
}

TEST(Core_LaunchEnv, Slurm) {
  const auto info = d9d::parse_launch_env(env_of({{"SLURM_PROCID", "6"},
                                                  {"SLURM_NTASKS", "8"},
                                                  {"SLURM_LOCALID", "2"},
                                                  {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                                  {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7"},
                                                  {"SLURM_JOB_ID", "123456"}}));
  EXPECT_EQ(info.launcher, d9d::Launcher::slurm);
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "10.0.0.7");
  EXPECT_EQ(info.master_port, 10000 + 123456 % 50000);
  // An empty variable counts as unset: the next source of the per-node count is read.
  const auto fallback = d9d::parse_launch_env(env_of({{"SLURM_PROCID", "0"},
                                                      {"SLURM_NTASKS", "4"},
                                                      {"SLURM_NTASKS_PER_NODE", ""},
                                                      {"SLURM_TASKS_PER_NODE", "2(x2)"},
                                                      {"MASTER_ADDR", "node0"}}));
  EXPECT_EQ(fallback.local_world_size, 2);
}

TEST(Core_LaunchEnv, ErrorsNameTheVariable) {
  EXPECT_THAT(launch_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), HasSubstr("RANK=\"x\""));
  EXPECT_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
              HasSubstr("MASTER_ADDR is required"));
  EXPECT_THAT(launch_error(
                  {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}),
              HasSubstr("rank 2 is outside the world of 2"));
  EXPECT_THAT(
      launch_error(
          {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}),
      HasSubstr("MASTER_PORT 70000 is not a TCP port"));
  EXPECT_THAT(launch_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
              HasSubstr("under Slurm, set MASTER_ADDR"));
}

// ------------------------------------------------------------------------------------------------
// Mesh layouts

std::vector<std::string> names(const std::vector<d9d::MeshDim>& dims) {
  std::vector<std::string> out;
  out.reserve(dims.size());
  for (const auto& dim : dims) {
    out.push_back(dim.name + "=" + std::to_string(dim.size));
  }
  return out;
}

TEST(Core_Mesh_Layout, FiveDomainsOfOneShape) {
  const MeshShape shape{.pp = 2,
                        .dp_replicate = 2,
                        .dp_shard = 3,
                        .cp_replicate = 1,
                        .cp_shard = 2,
                        .tp = 2,
                        .ep = 4};
  using V = std::vector<std::string>;
  EXPECT_EQ(names(d9d::DeviceMesh::layout(shape, MeshDomain::regular)),
            (V{"pp=2", "dp_replicate=2", "dp_shard=3", "cp_shard=2", "cp_replicate=1", "tp=2"}));
  EXPECT_EQ(names(d9d::DeviceMesh::layout(shape, MeshDomain::dense)),
            (V{"pp=2", "dp_replicate=2", "dp_cp_shard=6", "cp_replicate=1", "tp=2"}));
  EXPECT_EQ(names(d9d::DeviceMesh::layout(shape, MeshDomain::expert)),
            (V{"pp=2", "ep_dp_replicate=2", "ep_replicate=3", "ep_shard=4"}));
  // ep = 2 does not divide a replica's one rank: the expert groups span the replicas.
  EXPECT_EQ(
      names(d9d::DeviceMesh::layout(MeshShape{.dp_replicate = 2, .ep = 2}, MeshDomain::expert)),
      (V{"pp=1", "ep_dp_replicate=1", "ep_replicate=1", "ep_shard=2"}));
  EXPECT_EQ(names(d9d::DeviceMesh::layout(shape, MeshDomain::batch)),
            (V{"pp=2", "dp=6", "cp=2", "tp=2"}));
  EXPECT_EQ(names(d9d::DeviceMesh::layout(shape, MeshDomain::flat)), (V{"world=48"}));
}

TEST(Core_Mesh_Layout, DomainsAreViewsOfTheSameRanks) {
  // Every rank has the same pp coordinate in every domain, and groups partition the world.
  const MeshShape shape{.pp = 2, .dp_replicate = 2, .dp_shard = 2, .cp_shard = 2, .tp = 2, .ep = 4};
  for (int rank = 0; rank < 32; ++rank) {
    const auto regular = d9d::DeviceMesh::coordinates_of(shape, MeshDomain::regular, rank);
    const auto dense = d9d::DeviceMesh::coordinates_of(shape, MeshDomain::dense, rank);
    const auto batch = d9d::DeviceMesh::coordinates_of(shape, MeshDomain::batch, rank);
    const auto expert = d9d::DeviceMesh::coordinates_of(shape, MeshDomain::expert, rank);
    EXPECT_EQ(regular[0], dense[0]);
    EXPECT_EQ(regular[0], expert[0]);
    // dense dp_cp_shard = dp_shard * cp_shard (adjacent in the regular order)
    EXPECT_EQ(dense[2], regular[2] * 2 + regular[3]);
    // batch dp = dp_replicate * dp_shard, cp = cp_shard * cp_replicate
    EXPECT_EQ(batch[1], regular[1] * 2 + regular[2]);
    EXPECT_EQ(batch[2], regular[3]);
    // expert: the stage's ranks split as [ep_dp_replicate, ep_replicate, ep_shard], ep_shard
    // innermost, ep_dp_replicate the regular dp_replicate
    EXPECT_EQ(expert[3], (rank % 16) % 4);
    EXPECT_EQ(expert[1], regular[1]);
  }
  for (const auto domain : {MeshDomain::regular, MeshDomain::dense, MeshDomain::expert,
                            MeshDomain::batch, MeshDomain::flat}) {
    for (const auto& dim : d9d::DeviceMesh::layout(shape, domain)) {
      std::set<std::vector<int>> groups;
      std::multiset<int> seen;
      for (int rank = 0; rank < 32; ++rank) {
        const auto members = d9d::DeviceMesh::group_ranks_of(shape, domain, {dim.name}, rank);
        EXPECT_EQ(static_cast<int>(members.size()), dim.size);
        EXPECT_TRUE(std::find(members.begin(), members.end(), rank) != members.end());
        groups.insert(members);
      }
      for (const auto& group : groups) {
        seen.insert(group.begin(), group.end());
      }
      EXPECT_EQ(seen.size(), 32U) << to_string(domain) << " " << dim.name;
      EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), 32U);
    }
  }
}

TEST(Core_Mesh_Layout, GroupRanksAlongSeveralDims) {
  const MeshShape shape{.dp_replicate = 2, .dp_shard = 2, .tp = 2};
  // rank 5 = (dp_replicate 1, dp_shard 0, tp 1)
  EXPECT_EQ(d9d::DeviceMesh::group_ranks_of(shape, MeshDomain::regular, {"tp"}, 5),
            (std::vector<int>{4, 5}));
  EXPECT_EQ(
      d9d::DeviceMesh::group_ranks_of(shape, MeshDomain::regular, {"dp_shard", "dp_replicate"}, 5),
      (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(d9d::DeviceMesh::group_ranks_of(shape, MeshDomain::batch, {"dp"}, 5),
            (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(d9d::DeviceMesh::group_ranks_of(shape, MeshDomain::flat, {"world"}, 5).size(), 8U);
}

TEST(Core_Mesh_Layout, UnknownDimensionListsTheKnownOnes) {
  try {
    (void)d9d::DeviceMesh::group_ranks_of(MeshShape{}, MeshDomain::batch, {"dp_shard"}, 0);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the batch domain has no dimension \"dp_shard\"; its "
                                    "dimensions are pp, dp, cp, tp"));
  }
}

TEST(Core_MeshShape, ChecksNameTheRule) {
  const MeshShape good{.dp_shard = 4, .tp = 2};
  const MeshShape too_small{.dp_shard = 4};
  const MeshShape bad_ep{.dp_shard = 4, .tp = 2, .ep = 3};
  const MeshShape zero{.tp = 0};
  EXPECT_EQ(good.validate(8), "");
  EXPECT_THAT(too_small.validate(8), HasSubstr("but the world has 8"));
  EXPECT_THAT(bad_ep.validate(8), HasSubstr("ep = 3 must divide"));
  EXPECT_THAT(zero.validate(8), HasSubstr("tp = 0 is not a degree"));
}

// ------------------------------------------------------------------------------------------------
// Ranges

TEST(Core_ShardRange, ChunkRuleWithShortAndEmptyLastShards) {
  using R = d9d::ShardRange;
  EXPECT_EQ(d9d::shard_range(10, 4, 0), (R{0, 3}));
  EXPECT_EQ(d9d::shard_range(10, 4, 3), (R{9, 1}));
  EXPECT_EQ(d9d::shard_range(3, 4, 2), (R{2, 1}));
  EXPECT_EQ(d9d::shard_range(3, 4, 3), (R{3, 0}));
  EXPECT_EQ(d9d::shard_range(8, 4, 2), (R{4, 2}));
}

TEST(Core_SplitRange, FirstPartsTakeTheRemainder) {
  int64_t total = 0;
  for (int i = 0; i < 4; ++i) {
    const auto range = d9d::split_range(10, 4, i);
    EXPECT_EQ(range.offset, total);
    EXPECT_EQ(range.length, i < 2 ? 3 : 2);
    total += range.length;
  }
  EXPECT_EQ(total, 10);
}

// ------------------------------------------------------------------------------------------------
// Batch trees

core_test::Batch make_batch(int64_t rows) {
  core_test::Batch batch;
  batch.input_ids = at::arange(rows * 3).reshape({rows, 3});
  batch.labels = at::arange(rows) * 10;
  batch.mask = at::ones({rows, 3}, at::kBool);
  batch.extra = {{"weights", at::rand({rows})}, {"position_ids", at::arange(3)}};
  batch.images = {at::rand({rows, 2, 2}), at::rand({rows, 1})};
  batch.pair = {at::arange(rows * 2).reshape({rows, 2}), 7};
  batch.step = 42;
  return batch;
}

d9d::LeafSpec spec_for(std::string_view path) {
  if (path == "extra{position_ids}") {
    return d9d::ReplicateLeaf{};
  }
  return d9d::ShardAlong{0};
}

TEST(Core_BatchTree, SplitAndMergeRoundTripUneven) {
  const auto batch = make_batch(10);
  const auto parts = d9d::split_batch(batch, 4, spec_for);
  ASSERT_EQ(parts.size(), 4U);
  const std::vector<int64_t> sizes = {3, 3, 2, 2};
  for (std::size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(parts[i].input_ids.size(0), sizes[i]);
    EXPECT_EQ(parts[i].labels.size(0), sizes[i]);
    EXPECT_EQ(parts[i].mask->size(0), sizes[i]);
    EXPECT_EQ(parts[i].extra.at("weights").size(0), sizes[i]);
    EXPECT_EQ(parts[i].extra.at("position_ids").size(0), 3);  // replicated
    EXPECT_EQ(parts[i].images[1].size(0), sizes[i]);
    EXPECT_EQ(std::get<0>(parts[i].pair).size(0), sizes[i]);
    EXPECT_EQ(std::get<1>(parts[i].pair), 7);
    EXPECT_EQ(parts[i].step, 42);
  }
  EXPECT_TRUE(at::equal(parts[1].labels, at::tensor({30, 40, 50}, at::kLong)));
  const auto merged = d9d::merge_batches(parts, spec_for);
  EXPECT_TRUE(at::equal(merged.input_ids, batch.input_ids));
  EXPECT_TRUE(at::equal(merged.labels, batch.labels));
  EXPECT_TRUE(at::equal(*merged.mask, *batch.mask));
  EXPECT_TRUE(at::equal(merged.extra.at("weights"), batch.extra.at("weights")));
  EXPECT_TRUE(at::equal(merged.extra.at("position_ids"), batch.extra.at("position_ids")));
  EXPECT_TRUE(at::equal(merged.images[0], batch.images[0]));
  EXPECT_TRUE(at::equal(std::get<0>(merged.pair), std::get<0>(batch.pair)));
  EXPECT_EQ(merged.step, 42);
}

TEST(Core_BatchTree, PlainContainersAndOtherDims) {
  const std::map<std::string, at::Tensor> batch = {{"x", at::rand({2, 6})},
                                                   {"y", at::rand({2, 6, 1})}};
  const auto parts = d9d::split_batch(batch, 3, d9d::ShardAlong{1});
  EXPECT_EQ(parts[2].at("x").sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_TRUE(at::equal(d9d::merge_batches(parts, d9d::ShardAlong{1}).at("y"), batch.at("y")));
}

TEST(Core_BatchTree, TooFewRowsIsAnError) {
  const auto batch = make_batch(3);
  try {
    (void)d9d::split_batch(batch, 4, spec_for);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("leaf \"input_ids\" has 3 rows along dim 0, fewer than the 4"));
  }
}

// ------------------------------------------------------------------------------------------------
// Local mode

TEST(Core_Context_Local, WorksWithoutEnvironmentOrCommunication) {
  const auto ctx = d9d::DistributedContext::local();
  EXPECT_EQ(ctx.rank(), 0);
  EXPECT_EQ(ctx.world_size(), 1);
  EXPECT_EQ(ctx.backend_name(), "none");
  EXPECT_TRUE(ctx.is_main_process());
#ifdef D9D_WITH_CUDA
  const bool cuda = torch::cuda::is_available();
#else
  const bool cuda = false;
#endif
  // The default device: cuda:LOCAL_RANK when this build has CUDA and sees a GPU, else cpu.
  EXPECT_EQ(ctx.device(), cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
  ctx.barrier();
  int calls = 0;
  ctx.main_process_first([&] { ++calls; });
  EXPECT_EQ(calls, 1);

  const d9d::DeviceMesh mesh(ctx, MeshShape{});
  const auto group = mesh.group(MeshDomain::batch, "dp");
  EXPECT_EQ(group.size(), 1);
  EXPECT_EQ(group.backend(), nullptr);
  const auto x = at::arange(6.0).reshape({2, 3});
  EXPECT_TRUE(at::equal(d9d::all_reduce(group, x), x));
  EXPECT_TRUE(at::equal(d9d::all_gather_cat(group, x), x));
  EXPECT_TRUE(at::equal(d9d::broadcast_varying(group, x, 0), x));
  EXPECT_EQ(d9d::all_gather_object(group, std::string("only")), std::vector<std::string>{"only"});
  const auto sharded =
      d9d::ShardedTensor::distribute(x, mesh, MeshDomain::flat, {"world"}, {d9d::Shard{1}});
  EXPECT_TRUE(at::equal(sharded.full_tensor(), x));
  EXPECT_THAT(ctx.logger().prefix(), HasSubstr("[d9d rank 0/1"));
}

TEST(Core_Context_Local, FromEnvWithNothingSetIsLocal) {
  // The test runner sets none of the launch variables.
  const auto ctx = d9d::DistributedContext::from_env();
  EXPECT_EQ(ctx.launcher(), d9d::Launcher::local);
  EXPECT_EQ(ctx.world_size(), 1);
}

}  // namespace
