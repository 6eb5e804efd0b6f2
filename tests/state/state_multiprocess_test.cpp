// Multi-process tests of d9d/state/mapper_distributed.hpp with d9d/state/stream.hpp: two Gloo ranks
// stream one checkpoint through distribute and each materialises only its own shard, bit-identical
// to slicing the full tensor; load_into fills a parallelised module's local shards; gather_full
// puts the shards back together.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
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

void save_layout(const std::string& dir, Layout l, int seed,
                 const st::DistributedSaveOptions& options = {}) {
  d9d::testing::run_on_ranks({.world_size = layout_world(l)}, [&](RankEnv&) {
    const auto ctx = cpu_context();
    const auto layout = make_layout(l, ctx);
    st::DistributedState state;
    for (const auto& [name, full] : matrix_tensors(seed)) {
      state.emplace_back(name, d9d::ShardedTensor::distribute(full, layout.mesh, layout.domain,
                                                              layout.dims, layout.placements));
    }
    state.emplace_back("b", plain_tensor(seed));
    st::save_distributed(ctx, dir, state, options);
  });
}

// Every rank of `l` loads each of `dirs` and compares with slicing the full tensors.
void check_load(const std::vector<std::string>& dirs, Layout l, int seed) {
  d9d::testing::run_on_ranks({.world_size = layout_world(l)}, [&](RankEnv&) {
    const auto ctx = cpu_context();
    const auto layout = make_layout(l, ctx);
    for (const auto& dir : dirs) {
      std::vector<st::DistributedLoadTarget> targets{{.name = "b"}};
      for (const auto& [name, full] : matrix_tensors(seed)) {
        targets.push_back({.name = name, .layout = layout});
      }
      const auto got = st::load_distributed(dir, targets);
      expect_bit_identical(got.at("b"), plain_tensor(seed), dir + " b");
      for (const auto& [name, full] : matrix_tensors(seed)) {
        const auto want = d9d::ShardedTensor::distribute(full, layout.mesh, layout.domain,
                                                         layout.dims, layout.placements)
                              .local();
        expect_bit_identical(
            got.at(name), want,
            dir + " -> " + layout_label(l) + " rank " + std::to_string(ctx.rank()) + " " + name);
      }
    }
  });
}

// One launch per TEST (d9d/testing/multiprocess.hpp), so saving with N ranks and loading with M
// are separate tests of one suite, run in the order written (GoogleTest's default), sharing a
// directory under TEST_TMPDIR (inherited by the rank processes). Run the suite as a whole.
std::string shared_root() {
  const char* base = std::getenv("TEST_TMPDIR");  // NOLINT(concurrency-mt-unsafe)
  return std::string(base != nullptr ? base : "/tmp") + "/d9d-distributed-save";
}

std::vector<std::string> matrix_dirs() {
  std::vector<std::string> dirs;
  for (const Layout l : kLayouts) {
    dirs.push_back(shared_root() + "/" + layout_label(l));
  }
  return dirs;
}

// 6 layouts saved, each loaded on all 6 layouts: 36 pairs (1<->2<->4 ranks, replicate <->
// sharded, a 2x2 mesh), bit-identical.
#define D9D_SAVE_CASE(L)                                                    \
  TEST(State_DistributedSave_Gloo, Save_##L) {                              \
    const std::string dir = shared_root() + "/" + layout_label(Layout::L);  \
    save_layout(dir, Layout::L, /*seed=*/1);                                \
    EXPECT_TRUE(d9d::files::exists(dir + "/" + st::kDistributedIndexName)); \
    EXPECT_FALSE(d9d::files::exists(dir + ".partial"));                     \
  }
#define D9D_LOAD_CASE(L)                                        \
  TEST(State_DistributedSave_Gloo, LoadAllSavedLayoutsAs_##L) { \
    check_load(matrix_dirs(), Layout::L, /*seed=*/1);           \
  }
D9D_SAVE_CASE(rep1)
D9D_SAVE_CASE(shard2)
D9D_SAVE_CASE(rep2)
D9D_SAVE_CASE(shard4_dim0)
D9D_SAVE_CASE(shard4_dim1)
D9D_SAVE_CASE(mesh2x2)
D9D_LOAD_CASE(rep1)
D9D_LOAD_CASE(shard2)
D9D_LOAD_CASE(rep2)
D9D_LOAD_CASE(shard4_dim0)
D9D_LOAD_CASE(shard4_dim1)
D9D_LOAD_CASE(mesh2x2)
#undef D9D_SAVE_CASE
#undef D9D_LOAD_CASE

// A rank killed after writing its file of checkpoint B, before the commit: the directory still
// loads A; so does an interrupted commit (only `<dir>.old` left).
std::string kill_dir() { return shared_root() + "/kill/ckpt"; }

TEST(State_DistributedSave_Gloo, Kill0_SaveA) { save_layout(kill_dir(), Layout::shard2, 1); }

TEST(State_DistributedSave_Gloo, Kill1_RankDiesDuringSaveB) {
  const std::string dir = kill_dir();
  const auto result = d9d::testing::launch({.world_size = 2}, [&](RankEnv&) {
    const auto ctx = cpu_context();
    const auto layout = make_layout(Layout::shard2, ctx);
    st::DistributedState state;
    for (const auto& [name, full] : matrix_tensors(2)) {
      state.emplace_back(name, d9d::ShardedTensor::distribute(full, layout.mesh, layout.domain,
                                                              layout.dims, layout.placements));
    }
    state.emplace_back("b", plain_tensor(2));
    st::save_distributed(ctx, dir, state, {.before_commit = [&] {
                           if (ctx.rank() == 1) {
                             std::_Exit(7);
                           }
                         }});
  });
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(d9d::files::exists(dir + ".partial"));
}

TEST(State_DistributedSave_Gloo, Kill2_LoadsAOnOneRank) {
  check_load({kill_dir()}, Layout::rep1, 1);
}

TEST(State_DistributedSave_Gloo, Kill3_LoadsAOnFourRanks) {
  check_load({kill_dir()}, Layout::shard4_dim1, 1);
}

TEST(State_DistributedSave_Gloo, Kill4_InterruptedCommitLoadsOld) {
  const std::string dir = kill_dir();
  if (!d9d::testing::is_rank_process()) {
    d9d::files::rename(dir, dir + ".old");  // as a crash between the two renames leaves it
  }
  check_load({dir}, Layout::shard2, 1);
}

}  // namespace
