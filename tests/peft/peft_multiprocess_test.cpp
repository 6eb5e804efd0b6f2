// LoRA with the parallel strategies on 2 ranks (Gloo, or NCCL with D9D_TEST_BACKEND=nccl) against
// one process training the same global batch, in float64 (tolerances: tests/train/
// train_test_util.hpp): under FullyShard over 2 ranks, and in a pipeline of 2 stages (1F1B, and
// ZeroBubbleH1, whose W actions compute the adapters' weight gradients). Tensor parallelism does
// not exist yet, so LoRA under tp is not tested.
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/state/safetensors.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;

using d9d::precision::Fp64;
namespace peft = d9d::peft;

// Adapters on every linear layer but the head, the embedding and the final norm trained too: the
// last two exist on one pipeline stage each, so their patterns match on one rank only.
using LoraStack = peft::Stack<peft::Lora<4, 8>, peft::Train<"model.embed_tokens", "model.norm">>;

// 6 steps, global batch 8 in microbatches of 2, clipping at 0.5 (tiny_run), 4 decoder layers.
// With `outputs`, the run exports (the merged model and the adapter) and writes its logs.
d9d::TrainerConfig run_config(const std::string& dir, const std::string& mesh = "",
                              bool outputs = false) {
  return tiny_run(dir, 6, 8, 2, outputs, 4, mesh);
}

template <class Peft>
RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx, bool outputs = false) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_plan<d9d::Plan<Peft, Fp64>>(
      local,
      tiny_run(env.scratch_dir() + "/one" + std::to_string(env.rank()), 6, 8, 8, outputs, 4));
}

// The tensors of two safetensors files agree by name (float32 files: the exports' dtype, so the
// bound is float32's rounding of values of size ~1 plus the runs' difference, kParameterAtol).
void expect_same_file(const std::string& got, const std::string& want) {
  const auto got_tensors = d9d::state::load_safetensors(got);
  const auto want_tensors = d9d::state::load_safetensors(want);
  ASSERT_EQ(got_tensors.size(), want_tensors.size()) << got;
  for (std::size_t i = 0; i < want_tensors.size(); ++i) {
    const auto& [name, value] = want_tensors[i];
    ASSERT_EQ(got_tensors[i].first, name) << got;
    ASSERT_EQ(got_tensors[i].second.sizes(), value.sizes()) << name;
    const double diff =
        (got_tensors[i].second.to(at::kDouble) - value.to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, d9d::testing::kParameterAtol + 1e-6 * value.abs().max().item<double>())
        << got << ": " << name;
  }
}

TEST(Peft_Lora_ws2, FullyShardMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
    const auto want = reference<LoraStack>(env, ctx, /*outputs=*/true);
    const auto got = train_plan<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, LoraStack, Fp64>>(
        ctx, run_config(dir + "/fsdp", "", /*outputs=*/true));
    d9d::testing::expect_same_run(got, want, "LoRA under FullyShard 2");
    // The export gathers the adapters' shards: the same adapter file (and config) and the same
    // merged model as one process writes.
    if (env.rank() == 0) {
      ASSERT_FALSE(got.result.adapter_dir.empty());
      expect_same_file(got.result.adapter_dir + "/adapter_model.safetensors",
                       want.result.adapter_dir + "/adapter_model.safetensors");
      EXPECT_EQ(d9d::model::read_text_file(got.result.adapter_dir + "/adapter_config.json"),
                d9d::model::read_text_file(want.result.adapter_dir + "/adapter_config.json"));
      expect_same_file(got.result.export_dir + "/model.safetensors",
                       want.result.export_dir + "/model.safetensors");
    } else {
      EXPECT_TRUE(got.result.adapter_dir.empty()) << "the main rank writes";
    }
    // Only what trains is recorded (and sharded); the frozen base stays whole on each rank.
    EXPECT_EQ(got.parameters.size(), want.parameters.size());
    EXPECT_EQ(got.parameters.size(), 4U * 7U * 2U + 2U);
    // Replicate over 2 ranks as well (the bucketed all-reduce of the adapters' gradients).
    using DpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<DpMesh, peft::Lora<4, 8, "*.q_proj", "*.v_proj">, Fp64>>(
            ctx, run_config(dir + "/replicate")),
        reference<peft::Lora<4, 8, "*.q_proj", "*.v_proj">>(env, ctx), "LoRA under Replicate 2");
  });
}

TEST(Peft_Lora_ws2, PipelineMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = reference<LoraStack>(env, ctx);
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, LoraStack, Fp64>>(
            ctx, run_config(dir + "/1f1b", R"({"pp": 2})")),
        want, "LoRA, pp 2, 1F1B");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<PpMesh, d9d::pipeline::ZeroBubbleH1<>, LoraStack, Fp64>>(
            ctx, run_config(dir + "/zb", R"({"pp": 2})")),
        want, "LoRA, pp 2, ZeroBubbleH1 (the adapters' weight gradients in W actions)");
  });
}

TEST(Peft_Lora_ws2, APatternMatchingOnNoStageFailsEveryRank) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    using Typo = peft::Stack<peft::Lora<4, 8>, peft::Train<"model.embed_token">>;
    try {
      (void)train_plan<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, Typo, Fp64>>(
          ctx, run_config(dir + "/typo", R"({"pp": 2})"));
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(R"(the pattern "model.embed_token")"),
                std::string::npos)
          << error.what();
    }
  });
}

}  // namespace
