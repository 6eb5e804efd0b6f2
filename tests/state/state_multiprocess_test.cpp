// Multi-process tests of d9d/state/mapper_distributed.hpp with d9d/state/stream.hpp: two Gloo ranks
// stream one checkpoint through distribute and each materialises only its own shard, bit-identical
// to slicing the full tensor; load_into fills a parallelised module's local shards; gather_full
// puts the shards back together.
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/state/mapper_distributed.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/state/stream.hpp>
#include <d9d/testing/multiprocess.hpp>

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

}  // namespace
