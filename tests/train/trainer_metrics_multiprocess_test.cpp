// A task's metrics in Trainer<Plan> on 3 Gloo ranks against the same run in one process: every
// logged value (metrics.jsonl on the main rank, TrainResult::metrics on every rank) equals the
// single-process one — exactly for counts (target tokens, samples, correct predictions), within
// the summation order for the loss mean. Data parallel over 3 ranks, and a pipeline of 3 stages
// whose main rank (stage 0) has no outputs and logs what the last stage counted.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/metrics/aggregation.hpp>
#include <d9d/metrics/collection.hpp>
#include <d9d/testing/multiprocess.hpp>
#include <d9d/train/trainer.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::testing::RankEnv;

using Fp64 = d9d::precision::Fp64;
using DpPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, Fp64>;
using PipelineMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_replicate<d9d::dynamic>>;
using PpPlan = d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>;
using OneProcessPlan = d9d::Plan<Fp64>;

constexpr int64_t kSteps = 5;       // tiny_run logs every 2 steps: 0, 2 and 4
constexpr int64_t kMicrobatch = 2;  // the global batch: one microbatch per rank
constexpr int kLayers = 4;

// Next-token prediction with token metrics. Without a pipeline compute_loss gives the logits as
// LossOutput::output; under one, output_loss leaves it unset and the trainer passes the last
// stage's output.
struct TokenMetricsTask : d9d::CausalLmTask {
  d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& model,
                               const d9d::CausalLmBatch& batch) {
    const auto& device = model->model->embed_tokens->weight.device();
    const auto logits = model->forward(stage_input(batch).to(device));
    auto out = output_loss(logits, batch);
    out.output = logits;
    return out;
  }
  [[nodiscard]] d9d::metrics::MetricCollection metrics() const {
    d9d::metrics::MetricCollection metrics;
    metrics.add("tokens", d9d::metrics::Sum{});
    metrics.add("samples", d9d::metrics::Sum{});
    metrics.add("correct", d9d::metrics::Sum{});
    metrics.add("token_accuracy", d9d::metrics::Mean{});
    metrics.add("loss", d9d::metrics::WeightedMean{});
    return metrics;
  }
  void update_metrics(const d9d::LossOutput& out, const d9d::CausalLmBatch& batch,
                      d9d::metrics::MetricCollection& metrics) const {
    ASSERT_TRUE(out.output.defined());
    const auto labels = batch.tokens.narrow(1, 1, batch.tokens.size(1) - 1).to(out.output.device());
    const auto hits = out.output.argmax(-1).eq(labels).to(at::kDouble);
    metrics.get<d9d::metrics::Sum>("tokens").update(static_cast<double>(labels.numel()));
    metrics.get<d9d::metrics::Sum>("samples").update(static_cast<double>(labels.size(0)));
    metrics.get<d9d::metrics::Sum>("correct").update(hits);
    metrics.get<d9d::metrics::Mean>("token_accuracy").update(hits);
    metrics.get<d9d::metrics::WeightedMean>("loss").update(out.loss_sum / out.weight, out.weight);
  }
};

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

// Counts exactly, the loss mean within the order of its sums (float64: 1e-9 relative).
void expect_same_metrics(const std::map<std::string, double>& got,
                         const std::map<std::string, double>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& [key, value] : want) {
    ASSERT_TRUE(got.contains(key)) << where << ": " << key;
    if (key == "metrics/loss") {
      EXPECT_NEAR(got.at(key), value, d9d::testing::kLossRtol * std::abs(value))
          << where << ": " << key;
    } else {
      EXPECT_EQ(got.at(key), value) << where << ": " << key;
    }
  }
}

std::map<std::string, double> metrics_of(const nlohmann::json& line) {
  std::map<std::string, double> out;
  for (const auto& [key, value] : line.items()) {
    if (key.starts_with("metrics/")) {
      out[key] = value.get<double>();
    }
  }
  return out;
}

template <class Plan>
void expect_metrics_match_one_process(RankEnv& env, const d9d::DistributedContext& ctx,
                                      const std::string& name, const std::string& mesh) {
  const int64_t global_batch = kMicrobatch * ctx.world_size();
  const std::string dir = env.scratch_dir() + "/" + name + std::to_string(env.rank());
  auto cfg = d9d::testing::tiny_run(dir + "/dist", kSteps, global_batch, kMicrobatch, false,
                                    kLayers, mesh);
  cfg.logging.jsonl = true;
  d9d::Trainer<Plan> distributed(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                 TokenMetricsTask{}, cfg);
  const auto result = distributed.train();

  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  auto one =
      d9d::testing::tiny_run(dir + "/one", kSteps, global_batch, kMicrobatch, false, kLayers);
  one.logging.jsonl = true;
  d9d::Trainer<OneProcessPlan> single(
      local, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, TokenMetricsTask{}, one);
  const auto reference = single.train();

  // Every rank holds the synced values of the last window.
  expect_same_metrics(result.metrics, reference.metrics,
                      name + " rank " + std::to_string(env.rank()));
  // Each window counts the global batch of each of its steps once: 1, 2 and 2 steps.
  const double tokens_per_step = static_cast<double>(global_batch * 16);
  EXPECT_EQ(result.metrics.at("metrics/tokens"), 2 * tokens_per_step) << name;
  EXPECT_EQ(result.metrics.at("metrics/samples"), static_cast<double>(2 * global_batch)) << name;
  EXPECT_EQ(result.metrics.at("metrics/token_accuracy"),
            result.metrics.at("metrics/correct") / result.metrics.at("metrics/tokens"))
      << name;
  if (env.rank() == 0) {
    const std::vector<nlohmann::json> lines = read_jsonl(result.metrics_path);
    const std::vector<nlohmann::json> want = read_jsonl(reference.metrics_path);
    ASSERT_EQ(lines.size(), 3U) << name;
    ASSERT_EQ(want.size(), 3U) << name;
    for (std::size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i].at("step"), want[i].at("step")) << name;
      expect_same_metrics(metrics_of(lines[i]), metrics_of(want[i]),
                          name + " line " + std::to_string(i));
    }
    EXPECT_EQ(lines[0].at("metrics/tokens").get<double>(), tokens_per_step) << name;
  }
  ctx.barrier();  // every rank is done with the trainer's groups before they go
}

// 2 ranks (so that two GPUs run it under NCCL) and 3.
class Trainer_Metrics_Gloo : public ::testing::TestWithParam<int> {};

TEST_P(Trainer_Metrics_Gloo, DataParallelLogsTheOneProcessValues) {
  const int world = GetParam();
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(world);
  d9d::testing::run_on_ranks({.world_size = world}, [world](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // n ranks x 1 microbatch of 2 against 1 process x n microbatches of 2.
    expect_metrics_match_one_process<DpPlan>(env, ctx, "dp" + std::to_string(world), "");
  });
}

TEST_P(Trainer_Metrics_Gloo, PipelineLogsTheLastStagesValuesOnTheMainRank) {
  const int world = GetParam();
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(world);
  d9d::testing::run_on_ranks({.world_size = world}, [world](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // pp n: n microbatches of 2 through n stages; only the last stage sees logits.
    const auto w = std::to_string(world);
    expect_metrics_match_one_process<PpPlan>(env, ctx, "pp" + w, R"({"pp": )" + w + "}");
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Trainer_Metrics_Gloo, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "ws" + std::to_string(info.param);
                         });

}  // namespace
