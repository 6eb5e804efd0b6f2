// Multi-process tests of d9d/state/mapper_distributed.hpp with d9d/state/stream.hpp: two Gloo ranks
// stream one checkpoint through distribute and each materialises only its own shard, bit-identical
// to slicing the full tensor; load_into fills a parallelised module's local shards; gather_full
// puts the shards back together.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/distributed.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/state/mapper_distributed.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/state/stream.hpp>
#include <d9d/testing/multiprocess.hpp>
#include <d9d/util/files.hpp>

namespace {

namespace st = d9d::state;
using d9d::testing::RankEnv;

d9d::DistributedContext cpu_context() {
  return d9d::DistributedContext::from_env({.init_timeout = std::chrono::seconds(60),
                                            .step_timeout = std::chrono::seconds(60),
                                            .device = "cpu"});
}

// Same dtype, shape and bytes.
void expect_bit_identical(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  ASSERT_TRUE(got.defined()) << name;
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  ASSERT_EQ(got.sizes(), want.sizes()) << name;
  const at::Tensor a = got.contiguous();
  const at::Tensor b = want.contiguous();
  EXPECT_EQ(std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()), 0) << name;
}

// Rows (w: 5 rows over 2 ranks, 3 + 2), a vector (b) and columns (e: 7 columns, 4 + 3), in BF16,
// F32 and F64 so that any reinterpretation would show.
st::NamedTensors full_tensors() {
  return {{"w", at::arange(15, at::kFloat).reshape({5, 3}).to(at::kBFloat16)},
          {"b", at::arange(4, at::kFloat) / 3},
          {"e", at::arange(14, at::kDouble).reshape({2, 7}) / 7}};
}

// Rank 0 writes the checkpoint (sharded: three files) into the launch's scratch directory.
std::string write_checkpoint(const RankEnv& env, const d9d::DistributedContext& ctx) {
  const std::string dir = env.scratch_dir() + "/ckpt";
  if (ctx.rank() == 0) {
    st::save_safetensors_sharded(dir, full_tensors(), 40);
  }
  ctx.barrier();
  return dir;
}

TEST(State_StreamDistributed_Gloo_ws2, EachRankMaterialisesOnlyItsShard) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = cpu_context();
    const std::string dir = write_checkpoint(env, ctx);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_shard = 2});
    const st::ShardLayout rows{.mesh = mesh, .dims = {"dp_shard"}, .placements = {d9d::Shard{0}}};
    const st::ShardLayout cols{.mesh = mesh, .dims = {"dp_shard"}, .placements = {d9d::Shard{1}}};
    const st::Mapper mapper =
        st::parallel({st::distribute({"w", "b"}, rows), st::distribute({"e"}, cols)});
    EXPECT_EQ(mapper.groups()[0].op, "distribute(regular: dp_shard=Shard(0))");

    std::map<std::string, at::Tensor> got;
    const auto stats = st::stream_state(
        st::StateSource::open(dir), mapper,
        [&](const std::string& name, const at::Tensor& t) { got.emplace(name, t); });
    std::map<std::string, at::Tensor> full;
    for (const auto& [name, tensor] : full_tensors()) {
      full.emplace(name, tensor);
    }
    const int rank = ctx.rank();
    uint64_t shard_bytes = 0;
    for (const auto& [name, dim] : std::map<std::string, int64_t>{{"w", 0}, {"b", 0}, {"e", 1}}) {
      const auto range = d9d::shard_range(full.at(name).size(dim), 2, rank);
      const at::Tensor want = full.at(name).narrow(dim, range.offset, range.length);
      expect_bit_identical(got.at(name), want, name);
      // Its own memory, exactly the shard's bytes: nothing of the full tensor stays behind.
      EXPECT_EQ(got.at(name).storage().nbytes(), want.nbytes()) << name;
      shard_bytes += want.nbytes();
    }
    EXPECT_EQ(stats.output_bytes, shard_bytes);
    EXPECT_EQ(stats.groups, 3U);
    EXPECT_EQ(stats.files_opened, 3U);  // w (30 B) | b (16 B) | e (112 B): 40-byte shards
  });
}

struct ShardedLinearImpl : torch::nn::Module {
  // This rank's rows of a 5 x 3 weight and its columns of a 2 x 7 table.
  explicit ShardedLinearImpl(int rank) {
    weight = register_parameter("weight", at::zeros({rank == 0 ? 3 : 2, 3}, at::kFloat));
    table = register_buffer("table", at::zeros({2, rank == 0 ? 4 : 3}, at::kDouble));
  }
  at::Tensor weight;
  at::Tensor table;
};

TEST(State_StreamDistributed_Gloo_ws2, LoadIntoAParallelisedModuleAndGatherBack) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = cpu_context();
    const std::string dir = write_checkpoint(env, ctx);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_shard = 2});
    const st::ShardLayout rows{.mesh = mesh, .dims = {"dp_shard"}, .placements = {d9d::Shard{0}}};
    const st::ShardLayout cols{.mesh = mesh, .dims = {"dp_shard"}, .placements = {d9d::Shard{1}}};
    const auto source = st::StateSource::open(dir);

    // Checkpoint names -> module names, then each rank keeps its shard.
    ShardedLinearImpl module(ctx.rank());
    const st::Mapper load =
        st::parallel({st::sequential({st::rename("w", "weight"), st::distribute({"weight"}, rows)}),
                      st::sequential({st::rename("e", "table"), st::distribute({"table"}, cols)}),
                      st::drop({"b"})});
    st::load_into(module, source, load);
    std::map<std::string, at::Tensor> full;
    for (const auto& [name, tensor] : full_tensors()) {
      full.emplace(name, tensor);
    }
    const auto r0 = d9d::shard_range(5, 2, ctx.rank());
    const auto r1 = d9d::shard_range(7, 2, ctx.rank());
    // BF16 -> F32 on copy: exact for these small integers.
    expect_bit_identical(module.weight.detach(),
                         full.at("w").narrow(0, r0.offset, r0.length).to(at::kFloat), "weight");
    expect_bit_identical(module.table, full.at("e").narrow(1, r1.offset, r1.length), "table");

    // distribute then gather_full: every rank gets the whole tensor back, bit for bit.
    const st::Mapper round_trip = st::sequential(
        {st::parallel({st::distribute({"w"}, rows), st::distribute({"e"}, cols), st::drop({"b"})}),
         st::parallel(
             {st::gather_full({{"w", {5, 3}}}, rows), st::gather_full({{"e", {2, 7}}}, cols)})});
    std::map<std::string, at::Tensor> got;
    st::stream_state(source, round_trip,
                     [&](const std::string& name, const at::Tensor& t) { got.emplace(name, t); });
    expect_bit_identical(got.at("w"), full.at("w"), "w");
    expect_bit_identical(got.at("e"), full.at("e"), "e");
  });
}

// ---- save_distributed / load_distributed: the resharding matrix and a kill during save. ----

// The layouts of the matrix: world size, mesh and placements (on the tensors split by rows).
enum class Layout { rep1, shard2, rep2, shard4_dim0, shard4_dim1, mesh2x2 };
constexpr Layout kLayouts[] = {Layout::rep1,        Layout::shard2,      Layout::rep2,
                               Layout::shard4_dim0, Layout::shard4_dim1, Layout::mesh2x2};

const char* layout_label(Layout l) {
  switch (l) {
    case Layout::rep1:
      return "rep1";
    case Layout::shard2:
      return "shard2";
    case Layout::rep2:
      return "rep2";
    case Layout::shard4_dim0:
      return "shard4_dim0";
    case Layout::shard4_dim1:
      return "shard4_dim1";
    case Layout::mesh2x2:
      return "mesh2x2";
  }
  return "?";
}

int layout_world(Layout l) {
  switch (l) {
    case Layout::rep1:
      return 1;
    case Layout::shard2:
    case Layout::rep2:
      return 2;
    default:
      return 4;
  }
}

st::ShardLayout make_layout(Layout l, const d9d::DistributedContext& ctx) {
  switch (l) {
    case Layout::rep1:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{}),
              .dims = {"dp_shard"},
              .placements = {d9d::Replicate{}}};
    case Layout::shard2:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.dp_shard = 2}),
              .dims = {"dp_shard"},
              .placements = {d9d::Shard{0}}};
    case Layout::rep2:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.dp_shard = 2}),
              .dims = {"dp_shard"},
              .placements = {d9d::Replicate{}}};
    case Layout::shard4_dim0:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.dp_shard = 4}),
              .dims = {"dp_shard"},
              .placements = {d9d::Shard{0}}};
    case Layout::shard4_dim1:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.dp_shard = 4}),
              .dims = {"dp_shard"},
              .placements = {d9d::Shard{1}}};
    case Layout::mesh2x2:
      return {.mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.dp_replicate = 2, .dp_shard = 2}),
              .dims = {"dp_replicate", "dp_shard"},
              .placements = {d9d::Replicate{}, d9d::Shard{0}}};
  }
  throw std::logic_error("layout");
}

// Uneven sizes (5, 3, 7 over 2 and 4 shards; 3 columns over 4 leaves an empty shard), BF16, F32,
// F64, I32, plus a plain (replicated) vector. `seed` changes every value (checkpoint A vs B).
st::NamedTensors matrix_tensors(int seed) {
  return {{"w", (at::arange(15, at::kFloat).reshape({5, 3}) + seed).to(at::kBFloat16)},
          {"e", (at::arange(35, at::kDouble).reshape({7, 5}) + seed) / 7},
          {"i", (at::arange(30, at::kInt).reshape({6, 5}) * (seed + 1))},
          {"f", (at::arange(24, at::kFloat).reshape({4, 6}) + seed) / 3}};
}

at::Tensor plain_tensor(int seed) { return at::arange(4, at::kFloat) / 3 + seed; }

st::DistributedState layout_state(const st::ShardLayout& layout, int seed) {
  st::DistributedState state;
  for (const auto& [name, full] : matrix_tensors(seed)) {
    state.emplace_back(name, d9d::ShardedTensor::distribute(full, layout.mesh, layout.domain,
                                                            layout.dims, layout.placements));
  }
  state.emplace_back("b", plain_tensor(seed));
  return state;
}

// This rank's pieces of checkpoint `dir` under layout `l` of `ctx`, compared with slicing the full
// tensors of `seed`.
void expect_loads(const std::string& dir, Layout l, const d9d::DistributedContext& ctx, int seed) {
  const auto layout = make_layout(l, ctx);
  std::vector<st::DistributedLoadTarget> targets{{.name = "b"}};
  for (const auto& [name, full] : matrix_tensors(seed)) {
    targets.push_back({.name = name, .layout = layout});
  }
  const auto got = st::load_distributed(dir, targets);
  expect_bit_identical(got.at("b"), plain_tensor(seed), dir + " b");
  for (const auto& [name, full] : matrix_tensors(seed)) {
    const auto want = d9d::ShardedTensor::distribute(full, layout.mesh, layout.domain, layout.dims,
                                                     layout.placements)
                          .local();
    expect_bit_identical(
        got.at(name), want,
        dir + " -> " + layout_label(l) + " rank " + std::to_string(ctx.rank()) + " " + name);
  }
}

// Each saved layout in its own test: the files are there, nothing is left in `<dir>.partial`.
class State_DistributedSave_Gloo : public ::testing::TestWithParam<Layout> {};

TEST_P(State_DistributedSave_Gloo, SavesEveryPieceOnce) {
  const Layout l = GetParam();
  const auto result = d9d::testing::launch({.world_size = layout_world(l)}, [l](RankEnv& env) {
    const auto ctx = cpu_context();
    st::save_distributed(ctx, env.scratch_dir() + "/ckpt", layout_state(make_layout(l, ctx), 1));
  });
  ASSERT_TRUE(result.ok()) << result.report();
  const std::string dir = *result.scratch_dir + "/ckpt";
  EXPECT_TRUE(d9d::files::exists(dir + "/" + st::kDistributedIndexName));
  for (int r = 0; r < layout_world(l); ++r) {
    EXPECT_TRUE(d9d::files::exists(dir + "/model-rank" + std::to_string(r) + "-of-" +
                                   std::to_string(layout_world(l)) + ".safetensors"));
  }
  EXPECT_FALSE(d9d::files::exists(dir + ".partial"));
  EXPECT_FALSE(d9d::files::exists(dir + ".old"));
}

// Each load layout in its own test, on 4 ranks that first save all six layouts themselves (so no
// test depends on another having run): the 1-rank save by rank 0 alone (a local context), the
// 2-rank ones by ranks 0 and 1 (a context of their own, named "pair" since ranks 2 and 3 do not
// create it), the 4-rank ones by all. Then the ranks of the load layout load every directory.
// 6 saved x 6 loaded = 36 pairs (1 <-> 2 <-> 4 ranks, replicate <-> sharded, a 2x2 mesh).
class State_DistributedLoad_Gloo_ws4 : public ::testing::TestWithParam<Layout> {};

TEST_P(State_DistributedLoad_Gloo_ws4, LoadsEverySavedLayout) {
  const Layout load = GetParam();
  d9d::testing::run_on_ranks({.world_size = 4}, [load](RankEnv& env) {
    const auto world = cpu_context();
    std::optional<d9d::DistributedContext> pair;
    if (env.rank() < 2) {
      auto launch = d9d::parse_launch_env([](std::string_view name) -> std::optional<std::string> {
        const char* value = std::getenv(std::string(name).c_str());  // NOLINT
        return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
      });
      launch.world_size = 2;
      launch.local_world_size = 2;
      pair = d9d::DistributedContext::from_launch(launch, {.init_timeout = std::chrono::seconds(60),
                                                           .step_timeout = std::chrono::seconds(60),
                                                           .name = "pair",
                                                           .device = "cpu"});
    }
    const auto one = d9d::DistributedContext::local({.device = "cpu"});
    // The context of a layout on this rank, if this rank takes part.
    const auto context_of = [&](Layout l) -> const d9d::DistributedContext* {
      switch (layout_world(l)) {
        case 1:
          return env.rank() == 0 ? &one : nullptr;
        case 2:
          return pair ? &*pair : nullptr;
        default:
          return &world;
      }
    };
    std::vector<std::string> dirs;
    for (const Layout l : kLayouts) {
      dirs.push_back(env.scratch_dir() + "/" + layout_label(l));
      if (const auto* ctx = context_of(l)) {
        st::save_distributed(*ctx, dirs.back(), layout_state(make_layout(l, *ctx), 1));
      }
      world.barrier();  // saved before anyone loads it
    }
    if (const auto* ctx = context_of(load)) {
      for (const auto& dir : dirs) {
        expect_loads(dir, load, *ctx, 1);
      }
    }
    world.barrier();
  });
}

std::string layout_param_name(const ::testing::TestParamInfo<Layout>& info) {
  return layout_label(info.param);
}

INSTANTIATE_TEST_SUITE_P(Layouts, State_DistributedSave_Gloo, ::testing::ValuesIn(kLayouts),
                         layout_param_name);
INSTANTIATE_TEST_SUITE_P(Layouts, State_DistributedLoad_Gloo_ws4, ::testing::ValuesIn(kLayouts),
                         layout_param_name);

// A rank killed after writing its file of checkpoint B, before the commit: the directory still
// loads A, and so does an interrupted commit (only `<dir>.old` left). The loads run in the parent
// process (a local context, the full tensors) after the launch, so the test stands alone.
TEST(State_DistributedSave_Gloo_ws2, RankKilledBeforeTheCommitLeavesTheLastCheckpoint) {
  const auto result = d9d::testing::launch({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = cpu_context();
    const auto layout = make_layout(Layout::shard2, ctx);
    const std::string dir = env.scratch_dir() + "/ckpt";
    st::save_distributed(ctx, dir, layout_state(layout, 1));                         // A
    st::save_distributed(ctx, dir, layout_state(layout, 2), {.before_commit = [&] {  // B
                           if (ctx.rank() == 1) {
                             std::_Exit(7);
                           }
                         }});
  });
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.ranks[1].exit_code, 7) << result.report();
  const std::string dir = *result.scratch_dir + "/ckpt";
  EXPECT_TRUE(d9d::files::exists(dir + ".partial"));
  const auto local = d9d::DistributedContext::local({.device = "cpu"});
  expect_loads(dir, Layout::rep1, local, 1);
  d9d::files::rename(dir, dir + ".old");  // as a crash between the two renames of the commit
  expect_loads(dir, Layout::rep1, local, 1);
}

// An error on one rank during a save (rank 2's extra tensor has a dtype safetensors cannot store,
// an std::invalid_argument) is thrown on every rank at once, naming rank 2, and nothing is
// committed. No watchdog, and
// collectives that would wait 10 minutes (step_timeout): if the others waited for rank 2 instead
// of hearing of its error, they would outlive the launch's 120 s and fail the test.
TEST(State_DistributedSave_Gloo_ws4, AnErrorOnOneRankIsThrownOnEveryRank) {
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::DistributedContext::from_env({.init_timeout = std::chrono::seconds(60),
                                                        .step_timeout = std::chrono::minutes(10),
                                                        .failure_timeout = {},
                                                        .device = "cpu"});
    const auto layout = make_layout(Layout::shard4_dim0, ctx);
    const std::string dir = env.scratch_dir() + "/ckpt";
    st::save_distributed(ctx, dir, layout_state(layout, 1));  // A
    auto bad = layout_state(layout, 2);
    if (ctx.rank() == 2) {
      bad.emplace_back("z", at::zeros({2}, at::kComplexDouble));
    }
    try {
      st::save_distributed(ctx, dir, bad);
      ADD_FAILURE() << "rank " << ctx.rank() << ": nothing thrown";
    } catch (const std::invalid_argument& e) {  // the kind of rank 2's error, on every rank
      EXPECT_THAT(std::string(e.what()),
                  ::testing::StartsWith("d9d::state::save_distributed: rank 2 failed: "));
      EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr("\"z\""));
    }
    expect_loads(dir, Layout::shard4_dim0, ctx, 1);  // still A
    // The ranks stay in step: the next save works.
    st::save_distributed(ctx, dir, layout_state(layout, 3));
    expect_loads(dir, Layout::shard4_dim0, ctx, 3);
  });
}

}  // namespace
