// d9d::Inference (include/d9d/infer/inference.hpp) on 2 and 4 Gloo ranks: per-sample scores of a
// causal LM loaded from a Hugging Face checkpoint (float64, written by the test) under FullyShard,
// tensor parallelism, both, a pipeline (pp 2) and a pipeline with FullyShard (pp 2 x 2), equal the
// one-process model's on every sample; each sample reaches
// exactly one sink once (13 samples, so the last global batch is padded), and a run started again
// after recorded progress continues after it.
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/core/collectives.hpp>
#include <d9d/infer/inference.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/support/error_of.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::RankEnv;
using ::testing::HasSubstr;

constexpr int64_t kSamples = 13;

using ShardPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::Fsdp, Fp64>;
using TpPlan = d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>, d9d::parallel::TensorParallel<>, Fp64>;
using PipelinePlan = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>>, d9d::pipeline::OneFOneB<>, Fp64>;
using PipelineShardPlan = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>,
                                    d9d::pipeline::OneFOneB<>, d9d::parallel::Fsdp, Fp64>;
using TpShardPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>,
                              d9d::parallel::TensorParallel<>, d9d::parallel::Fsdp, Fp64>;

// Rank 0 writes a float64 Qwen3 (seed 11: not the seed the inference's model starts from, so a
// load that misses a parameter shows) as dir/model.safetensors; every rank gets the one-process
// scores of all samples.
at::Tensor write_checkpoint(const d9d::DistributedContext& ctx, const std::string& dir) {
  const auto config =
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2));
  torch::manual_seed(11);
  d9d::model::Qwen3ForCausalLM model(config);
  model->to(at::kDouble);
  if (ctx.rank() == 0) {
    d9d::model::save_hf_checkpoint(*model, dir, "", at::kDouble);
  }
  ctx.barrier();
  // The config's data: RandomWindowsProvider with the run's seed (5) and sequence length 16.
  const d9d::testing::RandomWindows windows(kSamples, 16, 64, 5 + 99);
  std::vector<int64_t> all(kSamples);
  for (int64_t i = 0; i < kSamples; ++i) {
    all[static_cast<std::size_t>(i)] = i;
  }
  const at::NoGradGuard no_grad;
  return d9d::CausalLmScoreTask{}.infer(model, windows.get(all));
}

d9d::TrainerConfig config_for(const RankEnv& env, const std::string& name, const std::string& mesh,
                              const std::string& checkpoint) {
  // 4 samples per global batch: the 13 samples take 4 steps, the last one padded.
  // (The training sections are read but not used.)
  auto cfg = d9d::testing::tiny_run(env.scratch_dir() + "/" + name, 4, 4, 1, false, 2, mesh);
  cfg.checkpoint.init_from = checkpoint;
  return cfg;
}

struct RandomWindows13 {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  d9d::testing::RandomWindows build(const d9d::DataBuildContext& context) const {
    return {kSamples, context.sequence_length, 64, context.seed + 99};
  }
};

// Runs Inference<Plan> and checks its rows against `want`; every sample must reach one sink once
// (counted over all ranks). Returns the samples this rank's sink saw.
template <class Plan>
std::vector<int64_t> run_and_check(const d9d::DistributedContext& ctx, d9d::TrainerConfig cfg,
                                   const at::Tensor& want, int64_t first_expected,
                                   const std::string& what) {
  std::vector<int64_t> seen;
  d9d::Inference<Plan> inference(
      ctx, d9d::Qwen3Provider{}, RandomWindows13{}, d9d::CausalLmScoreTask{}, std::move(cfg),
      [&](const std::vector<int64_t>& samples, const at::Tensor& rows) {
        ASSERT_EQ(rows.size(0), static_cast<int64_t>(samples.size())) << what;
        for (std::size_t i = 0; i < samples.size(); ++i) {
          seen.push_back(samples[i]);
          const auto expected = want[samples[i]];
          EXPECT_TRUE(at::allclose(rows[static_cast<int64_t>(i)].cpu(), expected, 1e-10, 1e-10))
              << what << ": sample " << samples[i] << " " << rows[static_cast<int64_t>(i)] << " vs "
              << expected;
        }
      });
  const auto result = inference.run();
  EXPECT_EQ(result.resumed_at, first_expected) << what;
  EXPECT_EQ(result.samples, kSamples - first_expected) << what;
  auto counts = at::zeros({kSamples}, at::kLong);
  for (const int64_t sample : seen) {
    counts[sample] += 1;
  }
  counts = d9d::all_reduce(ctx.world(), counts.to(ctx.device())).cpu();
  for (int64_t i = 0; i < kSamples; ++i) {
    EXPECT_EQ(counts[i].item<int64_t>(), i < first_expected ? 0 : 1) << what << ": sample " << i;
  }
  return seen;
}

TEST(Inference_ws2, ShardedAndTensorParallelScoresEqualOneProcessAndResume) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string checkpoint = env.scratch_dir() + "/hf";
    const auto want = write_checkpoint(ctx, checkpoint);
    run_and_check<ShardPlan>(ctx, config_for(env, "shard", R"({"dp_shard": 2})", checkpoint), want,
                             0, "FullyShard 2");
    run_and_check<TpPlan>(ctx, config_for(env, "tp", R"({"tp": 2})", checkpoint), want, 0, "tp 2");

    run_and_check<PipelinePlan>(ctx, config_for(env, "pp", R"({"pp": 2})", checkpoint), want, 0,
                                "pp 2");

    // A run that stopped after 8 samples: the next one starts there.
    const std::string out = env.scratch_dir() + "/shard";
    if (ctx.rank() == 0) {
      std::FILE* file = std::fopen((out + "/inference_progress.json").c_str(), "w");
      ASSERT_NE(file, nullptr);
      std::fputs("{\"samples_done\": 8}\n", file);
      std::fclose(file);
    }
    ctx.barrier();
    run_and_check<ShardPlan>(ctx, config_for(env, "shard", R"({"dp_shard": 2})", checkpoint), want,
                             8, "FullyShard 2, resumed");

    // Without weights there is nothing to infer with.
    EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>([&] {
                  d9d::Inference<ShardPlan> missing(
                      ctx, d9d::Qwen3Provider{}, RandomWindows13{}, d9d::CausalLmScoreTask{},
                      config_for(env, "none", R"({"dp_shard": 2})", ""),
                      [](const std::vector<int64_t>&, const at::Tensor&) {});
                }),
                HasSubstr("\"init_from\""));
  });
}

TEST(Inference_ws4, TensorParallelAndPipelineTimesFullyShardScoresEqualOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string checkpoint = env.scratch_dir() + "/hf";
    const auto want = write_checkpoint(ctx, checkpoint);
    run_and_check<TpShardPlan>(
        ctx, config_for(env, "tp_shard", R"({"dp_shard": 2, "tp": 2})", checkpoint), want, 0,
        "tp 2 x FullyShard 2");
    run_and_check<PipelineShardPlan>(
        ctx, config_for(env, "pp_shard", R"({"pp": 2, "dp_shard": 2})", checkpoint), want, 0,
        "pp 2 x FullyShard 2");
  });
}

}  // namespace
