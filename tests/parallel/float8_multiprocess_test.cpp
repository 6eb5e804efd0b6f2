// d9d::precision::Float8 under data and pipeline parallelism on 2 Gloo ranks (or NCCL with
// D9D_TEST_BACKEND=nccl), against one process running the same float8 emulation: FullyShard with
// the weights gathered as float8 (WeightGather::float8; per row, and per tensor with the shards'
// maxima all-reduced) and in the compute dtype, in two reshard modes; Replicate with per-tensor
// scales; a ZeroBubbleH1 pipeline of 2 stages, whose float8
// weight gradients wait in W actions. Over Fp64 the float8 products are the only roundings that
// matter, and the quantisations are elementwise with scales from maxima (which no summation order
// changes), so the runs agree to float64's rounding — as long as every rank quantises the same
// tensors as the one process: the microbatches are single samples here, because a per-tensor or
// per-column (over the tokens) scale spans a microbatch. A plain Fp64 run differs by float8's
// error, so the comparisons see whether float8 ran at all. And in one process: which layers Float8
// marks, and the model it refuses.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::precision::Float8;
using d9d::precision::Fp64;
using d9d::precision::Scaling;
using d9d::precision::WeightGather;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;

using Rowwise = Float8<Scaling::rowwise, WeightGather::compute_dtype, Fp64>;
using RowwiseGathered = Float8<Scaling::rowwise, WeightGather::float8, Fp64>;
using Tensorwise = Float8<Scaling::tensorwise, WeightGather::compute_dtype, Fp64>;
using TensorwiseGathered = Float8<Scaling::tensorwise, WeightGather::float8, Fp64>;
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;

// 4 steps, global batch 8 in microbatches of one sample, 4 decoder layers.
d9d::TrainerConfig run_config(const std::string& dir, const std::string& mesh = "") {
  return tiny_run(dir, 4, 8, 1, false, 4, mesh);
}

template <class Precision>
RunOutcome one_process(RankEnv& env, const d9d::DistributedContext& ctx, const std::string& name) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_plan<d9d::Plan<Precision>>(
      local, run_config(env.scratch_dir() + "/one" + std::to_string(env.rank()) + name));
}

// FullyShard with the float8 weight gather of `Precision`, in the reshard modes after_forward and
// never (with a reduce-scatter per microbatch, and once per step), equals `want` (one process).
// Under "never" the weights stay gathered over the step's 4 microbatches per rank, whose
// backwards reuse the first one's float8 transposes (Float8Linear::weight_transposed): equal runs
// over 4 steps also say that no step reads the previous step's transposes.
template <class Precision>
void expect_gathered_runs_match(const d9d::DistributedContext& ctx, const std::string& dir,
                                const RunOutcome& want, const std::string& what) {
  for (const std::string mode : {"after_forward", "never", "never_once"}) {
    auto config = run_config(dir + "/f8-" + mode);
    config.data_parallel.reshard = mode == "never_once" ? "never" : mode;
    config.data_parallel.reduce_every_microbatch = mode != "never_once";
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Precision>>(ctx, config), want,
        what + ", reshard " + mode);
  }
}

// Float8 changed the run: its losses are not plain float64's.
void expect_float8_ran(const RunOutcome& float8, const RunOutcome& plain) {
  double most = 0.0;
  for (std::size_t i = 0; i < plain.result.losses.size(); ++i) {
    most = std::max(most, std::abs(float8.result.losses[i] - plain.result.losses[i]) /
                              std::abs(plain.result.losses[i]));
  }
  EXPECT_GT(most, 1e-5) << "the float8 run's losses equal plain float64's";
}

// The projections of attention and MLP run in float8, nothing else; a model without them is
// refused (Float8 would change nothing).
TEST(Parallel_Float8, MarksTheProjectionsAndRefusesAModelWithoutThem) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2)));
  const auto parallel = d9d::parallel::parallelize<d9d::Plan<Rowwise>>(mesh, {model.ptr()});
  std::vector<std::string> float8;
  for (const auto& item : model->named_modules()) {
    const auto linear = std::dynamic_pointer_cast<d9d::model::LinearImpl>(item.value());
    if (linear && linear->float8) {
      EXPECT_TRUE(linear->float8->rowwise) << item.key();
      float8.push_back(item.key());
    }
  }
  std::vector<std::string> want;
  for (const std::string layer : {"model.layers.0.", "model.layers.1."}) {
    for (const std::string name :
         {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
      want.push_back(layer + name);
    }
  }
  std::sort(float8.begin(), float8.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(float8, want);  // not lm_head
  const torch::nn::Linear plain(8, 8);
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                (void)d9d::parallel::parallelize<d9d::Plan<Rowwise>>(mesh, {plain.ptr()});
              }),
              ::testing::HasSubstr("has no d9d::model::Attention or d9d::model::SwiGlu"));
}

TEST(Parallel_Float8_ws2, FullyShardWithFloat8GathersMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = one_process<Rowwise>(env, ctx, "/rowwise");
    expect_float8_ran(want, one_process<Fp64>(env, ctx, "/plain"));
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    expect_gathered_runs_match<RowwiseGathered>(ctx, dir, want, "float8 gather");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Rowwise>>(
            ctx, run_config(dir + "/compute")),
        want, "compute-dtype gather");
  });
}

// Per tensor, a weight's scale spans both ranks' rows: with every float8 weight's second half of
// rows (rank 1's shard) 64 times larger, rank 0's rows alone would give another power of two, so
// the gathered weights equal one process's only through the all-reduced maxima.
TEST(Parallel_Float8_ws2, FullyShardWithTensorwiseFloat8GathersMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2));
    const auto build = [&](const d9d::DeviceMesh& mesh, auto plan) {
      torch::manual_seed(5);
      d9d::model::Qwen3ForCausalLM model(config);
      model->to(mesh.context().device());
      const at::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        const auto name = item.key();
        if (name.find("_proj.weight") != std::string::npos) {
          const int64_t half = item.value().size(0) / 2;
          item.value().narrow(0, half, item.value().size(0) - half).mul_(64.0);
        }
      }
      auto parallel = d9d::parallel::parallelize<decltype(plan)>(mesh, {model.ptr()});
      parallel->begin_step();  // FullyShard gathers the parameters outside blocks here
      return std::make_pair(model, std::move(parallel));
    };
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const d9d::DeviceMesh one_mesh(local, d9d::MeshShape{});
    const d9d::DeviceMesh shard_mesh(ctx, d9d::MeshShape{.dp_shard = 2});
    auto [whole, whole_parallel] = build(one_mesh, d9d::Plan<Tensorwise>{});
    auto [shard, shard_parallel] =
        build(shard_mesh, d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, TensorwiseGathered>{});
    auto generator = at::detail::createCPUGenerator(29);
    const auto ids = at::randint(64, {2, 16}, generator, at::kLong).to(ctx.device());
    const auto want = whole->forward(ids);
    const auto got = shard->forward(ids);
    EXPECT_TRUE(at::allclose(got, want, 0.0, 1e-12)) << (got - want).abs().max().item<double>();
    // And the rows scaled alike in a plain Fp64 model give other logits (float8 ran).
    auto [plain, plain_parallel] = build(one_mesh, d9d::Plan<Fp64>{});
    EXPECT_GT((plain->forward(ids) - want).abs().max().item<double>(), 1e-6);
    // Training: both reshard modes against one process.
    expect_gathered_runs_match<TensorwiseGathered>(
        ctx, env.scratch_dir() + "/t" + std::to_string(env.rank()),
        one_process<Tensorwise>(env, ctx, "/tensorwise"), "tensorwise float8 gather");
  });
}

TEST(Parallel_Float8_ws2, ReplicateWithTensorwiseScalesMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = one_process<Tensorwise>(env, ctx, "/tensorwise");
    expect_float8_ran(want, one_process<Fp64>(env, ctx, "/plain"));
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, Tensorwise>>(
            ctx, run_config(env.scratch_dir() + "/r" + std::to_string(env.rank()))),
        want, "Replicate, tensorwise");
  });
}

TEST(Parallel_Float8_ws2, ZeroBubblePipelineMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = one_process<Rowwise>(env, ctx, "/rowwise");
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<PpMesh, d9d::pipeline::ZeroBubbleH1<>, Rowwise>>(
            ctx, run_config(env.scratch_dir() + "/r" + std::to_string(env.rank()), R"({"pp": 2})")),
        want, "pp 2, ZeroBubbleH1 (float8 weight gradients in W actions)");
  });
}

}  // namespace
