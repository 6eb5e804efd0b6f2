// Multi-process tests of the distributed core on 1, 2, 4 and 8 ranks (Gloo on CPU; NCCL with
// D9D_TEST_BACKEND=nccl where the GPUs suffice). Every result is checked against what a single
// process computes from the same inputs.
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/object_collectives.hpp>
#include <d9d/core/sharded_tensor.hpp>

#include "tests/core/core_test_util.hpp"

namespace {

using d9d::MeshDomain;
using d9d::MeshShape;
using d9d::testing::RankEnv;
using ::testing::HasSubstr;

// Meshes exercised per world size (each valid for that world).
std::vector<MeshShape> shapes_for(int world) {
  switch (world) {
    case 1:
      return {MeshShape{}};
    case 2:
      return {MeshShape{.dp_shard = 2}, MeshShape{.tp = 2}, MeshShape{.pp = 2},
              MeshShape{.cp_shard = 2, .ep = 2}};
    case 4:
      return {MeshShape{.dp_replicate = 2, .dp_shard = 2}, MeshShape{.pp = 2, .tp = 2, .ep = 2},
              MeshShape{.dp_shard = 2, .cp_replicate = 2, .ep = 4}};
    default:
      return {MeshShape{.dp_replicate = 2, .dp_shard = 2, .tp = 2, .ep = 4},
              MeshShape{.pp = 2, .dp_shard = 2, .cp_shard = 2, .ep = 2},
              MeshShape{.dp_shard = 2, .cp_replicate = 2, .cp_shard = 2, .ep = 8}};
  }
}

class Core_World : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(GetParam()); }
  [[nodiscard]] d9d::testing::LaunchOptions options() const { return {.world_size = GetParam()}; }
};

std::string world_name(const ::testing::TestParamInfo<int>& info) {
  return "ws" + std::to_string(info.param);
}

// ------------------------------------------------------------------------------------------------
// Context

TEST_P(Core_World, ContextFromEnvironment) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    EXPECT_EQ(ctx.rank(), env.rank());
    EXPECT_EQ(ctx.world_size(), env.world_size());
    EXPECT_EQ(ctx.local_rank(), env.rank());
    EXPECT_EQ(ctx.launcher(), d9d::Launcher::torchrun);
    EXPECT_EQ(ctx.is_main_process(), env.rank() == 0);
    EXPECT_EQ(ctx.backend_name(), env.world_size() == 1                          ? "none"
                                  : env.backend() == d9d::testing::Backend::nccl ? "nccl"
                                                                                 : "gloo");
    EXPECT_THAT(ctx.logger().prefix(), HasSubstr("rank " + std::to_string(env.rank()) + "/" +
                                                 std::to_string(env.world_size())));
    // main_process_first: the main process's file exists when any other rank runs.
    const std::string marker = env.scratch_dir() + "/main-was-first";
    ctx.main_process_first([&] {
      if (ctx.is_main_process()) {
        std::ofstream(marker) << "x";
      } else {
        EXPECT_TRUE(std::ifstream(marker).good()) << "rank " << ctx.rank() << " ran first";
      }
    });
    ctx.barrier();
  });
}

// ------------------------------------------------------------------------------------------------
// Mesh

TEST_P(Core_World, MeshGroupsHaveTheRightMembers) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    for (const auto& shape : shapes_for(env.world_size())) {
      const d9d::DeviceMesh mesh(ctx, shape);
      for (const auto domain : {MeshDomain::regular, MeshDomain::dense, MeshDomain::expert,
                                MeshDomain::batch, MeshDomain::flat}) {
        const auto dims = mesh.dims(domain);
        for (std::size_t i = 0; i < dims.size(); ++i) {
          const auto group = mesh.group(domain, dims[i].name);
          const auto expected =
              d9d::DeviceMesh::group_ranks_of(shape, domain, {dims[i].name}, ctx.rank());
          // Who is in the group, as the group itself sees it: sum of one-hot rank vectors.
          auto one_hot = at::zeros({ctx.world_size()}, at::TensorOptions().device(ctx.device()));
          one_hot[ctx.rank()] = 1;
          const auto members = d9d::all_reduce(group, one_hot).cpu();
          auto want = at::zeros({ctx.world_size()});
          for (const int r : expected) {
            want[r] = 1;
          }
          EXPECT_TRUE(at::equal(members, want)) << shape.describe() << " " << to_string(domain)
                                                << "[" << dims[i].name << "] " << members;
          EXPECT_EQ(group.rank(), mesh.coordinate(domain, dims[i].name));
          EXPECT_EQ(group.size(), dims[i].size);
        }
      }
      // A group over two dimensions, requested in the same order on every rank.
      const auto dp =
          mesh.group(MeshDomain::regular, std::vector<std::string>{"dp_replicate", "dp_shard"});
      EXPECT_EQ(dp.size(), shape.dp_replicate * shape.dp_shard);
      EXPECT_EQ(dp.ranks(), mesh.group(MeshDomain::batch, "dp").ranks());
    }
  });
}

TEST_P(Core_World, MismatchedMeshFailsEveryRankWithoutHanging) {
  const int world = GetParam();
  // Caught: each rank sees the same message.
  d9d::testing::run_on_ranks(options(), [world](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    try {
      const d9d::DeviceMesh mesh(ctx, MeshShape{.dp_shard = world * 2});
      ADD_FAILURE() << "a mesh of " << world * 2 << " ranks was accepted on " << world;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("but the world has " + std::to_string(world)));
    }
    if (world > 1) {
      try {
        const d9d::DeviceMesh mesh(ctx, MeshShape{.dp_shard = world, .ep = world * 2});
        ADD_FAILURE() << "ep larger than the stage was accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_THAT(e.what(), HasSubstr("must divide"));
      }
    }
  });
}

TEST(Core_Mesh_ws4, UncaughtMeshErrorEndsEveryRankQuickly) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  const auto result =
      d9d::testing::launch({.world_size = 4, .timeout = std::chrono::minutes(5)}, [](RankEnv& env) {
        const auto ctx = d9d::testing::rank_context(env);
        const d9d::DeviceMesh mesh(ctx, MeshShape{.tp = 3});
      });
  for (const auto& rank : result.ranks) {
    EXPECT_FALSE(rank.ok());
    EXPECT_FALSE(rank.timed_out) << result.report();
    EXPECT_THAT(rank.output, HasSubstr("tp=3")) << result.report();
    EXPECT_THAT(rank.output, HasSubstr("but the world has 4")) << result.report();
  }
}

// ------------------------------------------------------------------------------------------------
// Collectives

TEST_P(Core_World, AllReduceAllGatherBroadcast) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto& world = ctx.world();
    const int n = ctx.world_size();
    const int r = ctx.rank();
    const auto opts = at::TensorOptions().dtype(at::kDouble).device(ctx.device());
    const auto mine = at::arange(6, opts).reshape({2, 3}) + 100 * r;
    // Reference: every rank's input, computed locally.
    std::vector<at::Tensor> all;
    all.reserve(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) {
      all.push_back(at::arange(6, opts).reshape({2, 3}) + 100 * k);
    }
    const auto stacked = at::stack(all);
    EXPECT_TRUE(at::allclose(d9d::all_reduce(world, mine), stacked.sum(0)));
    EXPECT_TRUE(at::allclose(d9d::all_reduce(world, mine, d9d::ReduceOp::avg), stacked.mean(0)));
    EXPECT_TRUE(
        at::equal(d9d::all_reduce(world, mine, d9d::ReduceOp::max), std::get<0>(stacked.max(0))));
    EXPECT_TRUE(
        at::equal(d9d::all_reduce(world, mine, d9d::ReduceOp::min), std::get<0>(stacked.min(0))));
    EXPECT_TRUE(at::equal(d9d::all_gather_cat(world, mine, 1), at::cat(all, 1)));
    EXPECT_TRUE(at::equal(d9d::all_gather_cat(world, mine), at::cat(all, 0)));
    EXPECT_TRUE(at::equal(d9d::all_gather_cat(world, mine, -1), at::cat(all, 1)));
    // A middle dimension of a 3-d tensor, and a non-contiguous input.
    const auto cube = (at::arange(24, opts).reshape({2, 3, 4}) + 100 * r).transpose(0, 2);
    std::vector<at::Tensor> cubes;
    cubes.reserve(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) {
      cubes.push_back((at::arange(24, opts).reshape({2, 3, 4}) + 100 * k).transpose(0, 2));
    }
    EXPECT_TRUE(at::equal(d9d::all_gather_cat(world, cube, 1), at::cat(cubes, 1)));
    EXPECT_FALSE(mine.is_same(d9d::all_reduce(world, mine)));  // a new tensor
    const int src = n - 1;
    EXPECT_TRUE(at::equal(d9d::broadcast(world, mine, src), all[static_cast<std::size_t>(src)]));
    const auto varying = at::arange(r + 1, opts);  // rank r: r + 1 elements
    const auto got = d9d::broadcast_varying(world, r == src ? varying : at::Tensor(), src);
    EXPECT_TRUE(at::equal(got, at::arange(src + 1, opts)));
    // A CPU tensor through an NCCL group comes back on the CPU.
    EXPECT_EQ(d9d::all_reduce(world, at::ones({2})).device(), c10::Device(c10::kCPU));
  });
}

TEST_P(Core_World, GatherAndVaryingShapes) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto& world = ctx.world();
    const int n = ctx.world_size();
    const int r = ctx.rank();
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(ctx.device());
    const auto shaped = [&](int k) { return at::full({k + 1, 2}, static_cast<float>(k), opts); };
    const auto gathered = d9d::all_gather_varying(world, shaped(r));
    ASSERT_EQ(static_cast<int>(gathered.size()), n);
    for (int k = 0; k < n; ++k) {
      EXPECT_TRUE(at::equal(gathered[static_cast<std::size_t>(k)], shaped(k))) << "from rank " << k;
    }
    const int dst = n / 2;
    const auto at_dst = d9d::gather_varying(world, shaped(r), dst);
    EXPECT_EQ(at_dst.size(), r == dst ? static_cast<std::size_t>(n) : 0U);
    for (std::size_t k = 0; k < at_dst.size(); ++k) {
      EXPECT_TRUE(at::equal(at_dst[k], shaped(static_cast<int>(k))));
    }
    const auto same = d9d::gather(world, at::full({3}, static_cast<float>(r), opts), 0);
    EXPECT_EQ(same.size(), r == 0 ? static_cast<std::size_t>(n) : 0U);
    for (std::size_t k = 0; k < same.size(); ++k) {
      EXPECT_TRUE(at::equal(same[k], at::full({3}, static_cast<float>(k), opts)));
    }
  });
}

TEST_P(Core_World, ReduceScatterAndUnevenAllToAll) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto& world = ctx.world();
    const int64_t n = ctx.world_size();
    const int r = ctx.rank();
    const auto opts = at::TensorOptions().dtype(at::kDouble).device(ctx.device());
    const auto input_of = [&](int k) {
      return at::arange(n * 4, opts).reshape({n * 2, 2}) * (k + 1);
    };
    at::Tensor total = at::zeros({n * 2, 2}, opts);
    for (int k = 0; k < n; ++k) {
      total += input_of(k);
    }
    const auto mine = input_of(r);
    EXPECT_TRUE(at::allclose(d9d::reduce_scatter(world, mine),
                             total.chunk(n, 0)[static_cast<std::size_t>(r)]));
    EXPECT_TRUE(at::equal(mine, input_of(r))) << "the input is only read";
    // Along a middle dimension (as sequence parallelism scatters [B, T, H] by tokens), averaged.
    const auto wide_of = [&](int k) {
      return at::arange(3 * n * 2 * 2, opts).reshape({3, n * 2, 2}) * (k + 1);
    };
    at::Tensor wide_total = at::zeros({3, n * 2, 2}, opts);
    for (int k = 0; k < n; ++k) {
      wide_total += wide_of(k);
    }
    const auto wide = wide_of(r);
    EXPECT_TRUE(at::allclose(d9d::reduce_scatter(world, wide, 1, d9d::ReduceOp::avg),
                             wide_total.chunk(n, 1)[static_cast<std::size_t>(r)] / n));
    EXPECT_TRUE(at::equal(wide, wide_of(r)));
    // Rank k sends (k + j) % 3 rows to rank j; rows carry (sender, receiver, index).
    const auto count = [](int from, int to) -> int64_t { return (from + to) % 3; };
    std::vector<int64_t> send_splits;
    std::vector<at::Tensor> rows;
    for (int j = 0; j < n; ++j) {
      send_splits.push_back(count(r, j));
      for (int64_t i = 0; i < count(r, j); ++i) {
        rows.push_back(at::tensor(
            {static_cast<double>(r), static_cast<double>(j), static_cast<double>(i)}, opts));
      }
    }
    const auto input = rows.empty() ? at::zeros({0, 3}, opts) : at::stack(rows);
    const auto recv_splits = d9d::exchange_splits(world, send_splits);
    std::vector<at::Tensor> expected_rows;
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(recv_splits[static_cast<std::size_t>(k)], count(k, r));
      for (int64_t i = 0; i < count(k, r); ++i) {
        expected_rows.push_back(at::tensor(
            {static_cast<double>(k), static_cast<double>(r), static_cast<double>(i)}, opts));
      }
    }
    const auto expected =
        expected_rows.empty() ? at::zeros({0, 3}, opts) : at::stack(expected_rows);
    EXPECT_TRUE(at::equal(d9d::all_to_all(world, input, send_splits, recv_splits), expected));
  });
}

TEST_P(Core_World, BatchedPointToPointRing) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const int n = ctx.world_size();
    if (n == 1) {
      return;  // nothing to send to
    }
    const int r = ctx.rank();
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(ctx.device());
    const int next = (r + 1) % n;
    const int prev = (r + n - 1) % n;
    auto from_prev = at::empty({4}, opts);
    auto from_next = at::empty({4}, opts);
    auto requests = d9d::batch_isend_irecv(
        ctx.world(),
        {{.kind = d9d::P2POp::Kind::send, .tensor = at::full({4}, r * 1.0F, opts), .peer = next},
         {.kind = d9d::P2POp::Kind::send,
          .tensor = at::full({4}, r * 2.0F, opts),
          .peer = prev,
          .tag = 1},
         {.kind = d9d::P2POp::Kind::recv, .tensor = from_prev, .peer = prev},
         {.kind = d9d::P2POp::Kind::recv, .tensor = from_next, .peer = next, .tag = 1}});
    requests.wait();
    // With two ranks prev == next: the messages stay apart by tag (Gloo) and by order (NCCL).
    EXPECT_TRUE(at::equal(from_prev, at::full({4}, prev * 1.0F, opts)));
    EXPECT_TRUE(at::equal(from_next, at::full({4}, next * 2.0F, opts)));
  });
}

TEST_P(Core_World, ObjectCollectives) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const int n = ctx.world_size();
    const int r = ctx.rank();
    const auto value_of = [](int k) {
      return std::map<std::string, std::vector<int>>{
          {"rank", {k}}, {"range", std::vector<int>(static_cast<std::size_t>(k), k)}};
    };
    const auto all = d9d::all_gather_object(ctx.world(), value_of(r));
    ASSERT_EQ(static_cast<int>(all.size()), n);
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(all[static_cast<std::size_t>(k)], value_of(k));
    }
    const auto names =
        d9d::gather_object(ctx.world(), std::string(static_cast<std::size_t>(r + 1), 'a'), 0);
    EXPECT_EQ(names.size(), r == 0 ? static_cast<std::size_t>(n) : 0U);
    for (std::size_t k = 0; k < names.size(); ++k) {
      EXPECT_EQ(names[k], std::string(k + 1, 'a'));
    }
    const auto config =
        d9d::broadcast_object(ctx.world(), r == 0 ? std::string("from rank 0") : std::string(), 0);
    EXPECT_EQ(config, "from rank 0");
  });
}

TEST_P(Core_World, ErrorAgreementThrowsTheFirstFailureOnEveryRank) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const int last = ctx.world_size() - 1;
    // Nobody failed: nothing is thrown.
    EXPECT_NO_THROW(d9d::raise_if_any_failed(ctx.world(), nullptr, "agree"));
    // The last rank failed with an invalid_argument: every rank throws one, naming that rank.
    std::exception_ptr error;
    if (ctx.rank() == last) {
      error = std::make_exception_ptr(std::invalid_argument("agree: bad shape [3]"));
    }
    try {
      d9d::raise_if_any_failed(ctx.world(), error, "agree");
      ADD_FAILURE() << "nothing thrown";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()),
                "agree: rank " + std::to_string(last) + " failed: bad shape [3]");
    }
    // Every rank failed: the lowest is named first, the others after it, as a runtime_error.
    try {
      d9d::raise_if_any_failed(
          ctx.world(),
          std::make_exception_ptr(std::runtime_error("disk " + std::to_string(ctx.rank()))),
          "agree");
      ADD_FAILURE() << "nothing thrown";
    } catch (const std::runtime_error& e) {
      std::string want = "agree: rank 0 failed: disk 0";
      if (last > 0) {
        want += last > 1 ? " (ranks " : " (rank ";
        for (int r = 1; r <= last; ++r) {
          want += (r > 1 ? ", " : "") + std::to_string(r);
        }
        want += " failed too)";
      }
      EXPECT_EQ(std::string(e.what()), want);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Core_World, ::testing::Values(1, 2, 4, 8), world_name);

// ------------------------------------------------------------------------------------------------
// Several contexts in one process

// `rounds` all-reduces over a mesh group of `ctx`, each checked: values are scaled by `scale`, so a
// context that received another context's messages would see the other's sums.
void sum_rounds(const d9d::DistributedContext& ctx, double scale, int rounds) {
  const d9d::DeviceMesh mesh(ctx, MeshShape{.dp_shard = ctx.world_size()});
  const auto group = mesh.group(MeshDomain::regular, "dp_shard");
  const int n = ctx.world_size();
  for (int i = 0; i < rounds; ++i) {
    const auto got = d9d::all_reduce(group, at::full({256}, scale * (ctx.rank() + 1 + i)));
    const double want = scale * (n * (n + 1) / 2.0 + n * i);
    EXPECT_TRUE(at::equal(got.cpu(), at::full({256}, want)))
        << ctx.store_prefix() << " round " << i << ": " << got[0].item<double>() << " != " << want;
  }
}

// Both contexts' rounds at once, from two threads whose collectives interleave as they come. Under
// NCCL the collectives of two communicators on one GPU must be issued in the same order on every
// rank (otherwise each rank's kernel can wait for a peer that is running the other communicator's
// kernel: a hang, seen on 2 H200s), so there the contexts take turns.
void sum_rounds_side_by_side(const d9d::DistributedContext& a, const d9d::DistributedContext& b,
                             int rounds) {
  if (d9d::testing::default_backend() == d9d::testing::Backend::nccl) {
    sum_rounds(b, 1000.0, rounds);
    sum_rounds(a, 1.0, rounds);
    return;
  }
  std::thread side([&] { sum_rounds(b, 1000.0, rounds); });
  sum_rounds(a, 1.0, rounds);
  side.join();
}

// This rank's launch facts for a context of the first `world` ranks.
d9d::LaunchInfo sub_world(int world) {
  auto info = d9d::parse_launch_env([](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());  // NOLINT(concurrency-mt-unsafe)
    return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
  });
  info.world_size = world;
  info.local_world_size = world;
  return info;
}

TEST(Core_Context_ws4, TwoContextsRunCollectivesSideBySide) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    // Two contexts over the same world in one process: each rendezvouses its groups under its own
    // keys, and their collectives, interleaved from two threads (Gloo), never meet.
    const auto a = d9d::testing::rank_context(env);
    const auto b = d9d::testing::rank_context(env);
    EXPECT_EQ(a.store_prefix(), "d9d/ctx0-of-4/");
    EXPECT_EQ(b.store_prefix(), "d9d/ctx1-of-4/");
    sum_rounds_side_by_side(a, b, 40);
    // A context that only ranks 0 and 1 create (of a world of 2) is named: the others' unnamed
    // count must not depend on it.
    if (env.rank() < 2) {
      const auto pair = d9d::DistributedContext::from_launch(
          sub_world(2), {.init_timeout = std::chrono::seconds(60),
                         .step_timeout = std::chrono::seconds(60),
                         .name = "pair",
                         .device = a.device().str()});
      EXPECT_EQ(pair.store_prefix(), "d9d/pair/");
      sum_rounds(pair, 7.0, 5);
    }
    const auto c = d9d::testing::rank_context(env);
    EXPECT_EQ(c.store_prefix(), "d9d/ctx2-of-4/");
    sum_rounds(c, 3.0, 2);
  });
}

TEST(Core_Context_ws2, TwoContextsShareTheStoreRankZeroServes) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    // As under tools/d9drun: rank 0's process serves the store (no agent). Its second context
    // shares the server its first one started on that port.
    if (env.rank() == 0) {
      env.store().set("port", std::to_string(d9d::testing::free_port()));
    }
    const auto port = env.store().get("port");
    auto launch = sub_world(2);
    launch.agent_store = false;
    launch.master_port = std::stoi(std::string(port.begin(), port.end()));
    const d9d::ContextOptions options{
        .init_timeout = std::chrono::seconds(60),
        .step_timeout = std::chrono::seconds(60),
        .failure_timeout = std::chrono::seconds(10),
        .device = env.backend() == d9d::testing::Backend::nccl ? "cuda" : "cpu"};
    const auto a = d9d::DistributedContext::from_launch(launch, options);
    const auto b = d9d::DistributedContext::from_launch(launch, options);
    EXPECT_NE(a.store_prefix(), b.store_prefix());
    sum_rounds_side_by_side(a, b, 20);
  });
}

// ------------------------------------------------------------------------------------------------
// Sharded tensors

std::vector<d9d::Placement> all_placements() {
  return {d9d::Shard{0}, d9d::Shard{1}, d9d::Replicate{}, d9d::Partial{}};
}

// A local tensor of `full` under `placements`, with Partial split as unequal summands
// (rank-dependent weights) rather than "everything on coordinate 0".
d9d::ShardedTensor make_sharded(const at::Tensor& full, const d9d::DeviceMesh& mesh,
                                MeshDomain domain, const std::vector<std::string>& dims,
                                const std::vector<d9d::Placement>& placements) {
  std::vector<d9d::Placement> no_partial = placements;
  at::Tensor weight = at::ones({}, full.options());
  for (std::size_t i = 0; i < placements.size(); ++i) {
    if (std::holds_alternative<d9d::Partial>(placements[i])) {
      no_partial[i] = d9d::Replicate{};
      const int k = mesh.size(domain, dims[i]);
      const int c = mesh.coordinate(domain, dims[i]);
      weight = weight * (2.0 * (c + 1) / (k * (k + 1)));  // weights over the dimension sum to 1
    }
  }
  auto base = d9d::ShardedTensor::distribute(full, mesh, domain, dims, no_partial);
  return {base.local() * weight, mesh, domain, dims, placements, full.sizes().vec()};
}

std::string describe(const std::vector<d9d::Placement>& placements) {
  std::string out;
  for (const auto& p : placements) {
    out += (out.empty() ? "" : ",") + d9d::to_string(p);
  }
  return "[" + out + "]";
}

// Checks src -> dst against the single-process truth: the full tensor, and the exact local
// shard for placements without Partial.
void check_redistribute(const at::Tensor& full, const d9d::DeviceMesh& mesh, MeshDomain domain,
                        const std::vector<std::string>& dims,
                        const std::vector<d9d::Placement>& src,
                        const std::vector<d9d::Placement>& dst) {
  const auto from = make_sharded(full, mesh, domain, dims, src);
  EXPECT_TRUE(at::allclose(from.full_tensor(), full)) << "full_tensor of " << describe(src);
  const auto to = from.redistribute(dst);
  EXPECT_EQ(to.placements(), dst);
  EXPECT_TRUE(at::allclose(to.full_tensor(), full)) << describe(src) << " -> " << describe(dst);
  bool has_partial = false;
  for (const auto& p : dst) {
    has_partial = has_partial || std::holds_alternative<d9d::Partial>(p);
  }
  if (!has_partial) {
    const auto want = d9d::ShardedTensor::distribute(full, mesh, domain, dims, dst).local();
    EXPECT_TRUE(at::allclose(to.local(), want)) << describe(src) << " -> " << describe(dst);
  }
  const auto ranges = to.local_ranges();
  for (std::size_t d = 0; d < ranges.size(); ++d) {
    EXPECT_EQ(to.local().size(static_cast<int64_t>(d)), ranges[d].length);
  }
}

TEST_P(Core_World, ShardedTensorEveryPlacementPairOnOneDim) {
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, MeshShape{.dp_shard = ctx.world_size()});
    at::manual_seed(7);
    const int n = ctx.world_size();
    // Uneven on both dims: 2n+1 rows (last shard shorter), 3 columns (empty shards when n > 3).
    const auto full = at::randn({2 * n + 1, 3}, at::kDouble).to(ctx.device());
    for (const auto& src : all_placements()) {
      for (const auto& dst : all_placements()) {
        check_redistribute(full, mesh, MeshDomain::regular, {"dp_shard"}, {src}, {dst});
      }
    }
  });
}

TEST_P(Core_World, ShardedTensorTwoAndThreeDimensionalMeshes) {
  const int world = GetParam();
  if (world < 4) {
    GTEST_SKIP() << "needs a mesh of at least 2 x 2";
  }
  d9d::testing::run_on_ranks(options(), [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const int n = ctx.world_size();
    const MeshShape shape = n == 4 ? MeshShape{.dp_replicate = 2, .dp_shard = 2}
                                   : MeshShape{.dp_replicate = 2, .dp_shard = 2, .tp = 2};
    const d9d::DeviceMesh mesh(ctx, shape);
    const std::vector<std::string> dims =
        n == 4 ? std::vector<std::string>{"dp_replicate", "dp_shard"}
               : std::vector<std::string>{"dp_replicate", "dp_shard", "tp"};
    at::manual_seed(11);
    const auto full = at::randn({7, 5}, at::kDouble).to(ctx.device());
    // Every combination of placements over the mesh dims, to and from a few targets, including
    // nested shards of one tensor dimension (Shard(0) twice).
    std::vector<std::vector<d9d::Placement>> combos = {{}};
    for (std::size_t i = 0; i < dims.size(); ++i) {
      std::vector<std::vector<d9d::Placement>> next;
      for (const auto& combo : combos) {
        for (const auto& p : all_placements()) {
          auto extended = combo;
          extended.push_back(p);
          next.push_back(extended);
        }
      }
      combos = next;
    }
    const std::vector<d9d::Placement> replicated(dims.size(), d9d::Replicate{});
    std::vector<d9d::Placement> nested(dims.size(), d9d::Shard{0});
    for (const auto& combo : combos) {
      check_redistribute(full, mesh, MeshDomain::regular, dims, combo, replicated);
      check_redistribute(full, mesh, MeshDomain::regular, dims, replicated, combo);
      check_redistribute(full, mesh, MeshDomain::regular, dims, combo, nested);
    }
  });
}

}  // namespace
