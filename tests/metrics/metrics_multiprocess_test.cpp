// Multi-process tests of d9d::metrics on 3 ranks (Gloo on CPU; NCCL with D9D_TEST_BACKEND=nccl):
// each rank updates with its part of one dataset, and the synced values equal what one process
// computes over the whole dataset: exactly for counts (confusion matrix, AUROC histograms, Min,
// Max), and for float sums within n * eps * sum|x| (two summation orders of the same n terms, each
// within (n - 1) * eps / 2 * sum|x| of the exact sum).
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/metrics/aggregation.hpp>
#include <d9d/metrics/auroc.hpp>
#include <d9d/metrics/collection.hpp>
#include <d9d/metrics/confusion_matrix.hpp>

#include "tests/core/core_test_util.hpp"

namespace {

using d9d::testing::RankEnv;

constexpr double kEps = std::numeric_limits<double>::epsilon();
constexpr int64_t kRows = 1000;
constexpr int64_t kClasses = 5;

// One dataset, the same in every process (a fixed seed, host generation).
struct Dataset {
  at::Tensor values;   // [N] float64
  at::Tensor weights;  // [N] float64 >= 0
  at::Tensor scores;   // [N] float64 in [0, 1]
  at::Tensor binary;   // [N] int64 0 / 1
  at::Tensor logits;   // [N, C] float32
  at::Tensor labels;   // [N] int64 in [0, C)
};

Dataset make_dataset() {
  std::mt19937_64 gen(2024);
  std::normal_distribution<double> normal(1.0, 3.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int64_t> cls(0, kClasses - 1);
  std::vector<double> values(kRows);
  std::vector<double> weights(kRows);
  std::vector<double> scores(kRows);
  std::vector<int64_t> binary(kRows);
  std::vector<float> logits(static_cast<std::size_t>(kRows * kClasses));
  std::vector<int64_t> labels(kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    const auto k = static_cast<std::size_t>(i);
    values[k] = normal(gen);
    weights[k] = 2 * unit(gen);
    scores[k] = unit(gen);
    binary[k] = unit(gen) < 0.2 + 0.6 * scores[k] ? 1 : 0;
    labels[k] = cls(gen);
    for (int64_t c = 0; c < kClasses; ++c) {
      logits[static_cast<std::size_t>(i * kClasses + c)] =
          static_cast<float>(normal(gen) + (c == labels[k] ? 2.0 : 0.0));
    }
  }
  return {at::tensor(values, at::kDouble),
          at::tensor(weights, at::kDouble),
          at::tensor(scores, at::kDouble),
          at::tensor(binary, at::kLong),
          at::tensor(logits, at::kFloat).reshape({kRows, kClasses}),
          at::tensor(labels, at::kLong)};
}

d9d::metrics::MetricCollection make_metrics() {
  d9d::metrics::MetricCollection m;
  m.add("sum", d9d::metrics::Sum{});
  m.add("mean", d9d::metrics::Mean{});
  m.add("weighted", d9d::metrics::WeightedMean{});
  m.add("min", d9d::metrics::Min{});
  m.add("max", d9d::metrics::Max{});
  m.add("auroc", d9d::metrics::BinnedAuroc({.num_bins = 1000}));
  m.add("cls", d9d::metrics::ConfusionMatrix({.num_classes = kClasses, .per_class = true}));
  m.add("binary", d9d::metrics::ConfusionMatrix(
                      {.task = d9d::metrics::ClassificationTask::binary, .threshold = 0.6}));
  return m;
}

// Updates every metric with rows [begin, end) in microbatches of 64 rows.
void update_rows(d9d::metrics::MetricCollection& m, const Dataset& d, int64_t begin, int64_t end,
                 const c10::Device& device) {
  for (int64_t at = begin; at < end; at += 64) {
    const auto n = std::min<int64_t>(64, end - at);
    const auto rows = [&](const at::Tensor& t) { return t.narrow(0, at, n).to(device); };
    m.get<d9d::metrics::Sum>("sum").update(rows(d.values));
    m.get<d9d::metrics::Mean>("mean").update(rows(d.values));
    m.get<d9d::metrics::WeightedMean>("weighted").update(rows(d.values), rows(d.weights));
    m.get<d9d::metrics::Min>("min").update(rows(d.values));
    m.get<d9d::metrics::Max>("max").update(rows(d.values));
    m.get<d9d::metrics::BinnedAuroc>("auroc").update(rows(d.scores), rows(d.binary));
    m.get<d9d::metrics::ConfusionMatrix>("cls").update(rows(d.logits), rows(d.labels));
    m.get<d9d::metrics::ConfusionMatrix>("binary").update(rows(d.scores), rows(d.binary));
  }
}

double abs_sum(const at::Tensor& t) { return t.abs().sum().item<double>(); }

// 2 ranks (so that two GPUs run it under NCCL) and 3.
class Metrics_Gloo : public ::testing::TestWithParam<int> {};

TEST_P(Metrics_Gloo, SyncedValuesEqualSingleProcessValues) {
  const int world = GetParam();
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(world);
  d9d::testing::run_on_ranks({.world_size = world}, [world](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto device = ctx.world().device();
    const auto data = make_dataset();

    // Uneven parts: 200, 450 and 350 rows (3 ranks); 350 and 650 (2).
    const auto bounds =
        world == 3 ? std::vector<int64_t>{0, 200, 650, kRows} : std::vector<int64_t>{0, 350, kRows};
    auto metrics = make_metrics();
    update_rows(metrics, data, bounds[env.rank()], bounds[env.rank() + 1], device);
    metrics.sync_start(ctx.world());
    // The next window starts before the sync is waited for: it must not leak into the result.
    metrics.reset();
    update_rows(metrics, data, 0, 100, device);

    auto whole = make_metrics();
    update_rows(whole, data, 0, kRows, c10::Device(c10::kCPU));
    const auto expected = whole.compute();
    const auto synced = metrics.compute_synced();
    ASSERT_EQ(synced.size(), expected.size());

    const double n = static_cast<double>(kRows);
    const double sum_tol = n * kEps * abs_sum(data.values);
    EXPECT_NEAR(synced.at("sum"), expected.at("sum"), sum_tol);
    EXPECT_NEAR(synced.at("mean"), expected.at("mean"), sum_tol / n);
    const double weight = data.weights.sum().item<double>();
    const double weighted_tol =
        n * kEps *
        (abs_sum(data.values * data.weights) + std::abs(expected.at("weighted")) * weight) / weight;
    EXPECT_NEAR(synced.at("weighted"), expected.at("weighted"), weighted_tol);
    for (const auto& [key, value] : expected) {
      if (key == "sum" || key == "mean" || key == "weighted") {
        continue;
      }
      EXPECT_EQ(synced.at(key), value) << key;  // counts: exact
    }
    EXPECT_EQ(synced.at("min"), data.values.min().item<double>());
    EXPECT_EQ(synced.at("max"), data.values.max().item<double>());
    EXPECT_GT(synced.at("auroc"), 0.6);
    EXPECT_EQ(synced.size(), 5U + 1 + 7 + 3 * kClasses + 4);

    // The synced confusion matrix is the whole dataset's, cell for cell.
    const auto& cls = metrics.get<d9d::metrics::ConfusionMatrix>("cls");
    EXPECT_TRUE(at::equal(metrics.get<d9d::metrics::ConfusionMatrix>("cls").compute_synced().matrix,
                          whole.get<d9d::metrics::ConfusionMatrix>("cls").compute().matrix));
    EXPECT_EQ(cls.compute().samples, 100.0);  // the local state is the new window's

    // Local values after the sync are this rank's own.
    EXPECT_EQ(metrics.compute().at("min"), data.values.narrow(0, 0, 100).min().item<double>());
  });
}

TEST_P(Metrics_Gloo, OneMetricSyncsOnItsOwnAndEmptyRanksMergeAsIdentity) {
  const int world = GetParam();
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(world);
  d9d::testing::run_on_ranks({.world_size = world}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto device = ctx.world().device();
    // Only rank 1 sees values: the others' +inf / -inf / zero counts are the identities.
    d9d::metrics::Min min;
    d9d::metrics::Max max;
    d9d::metrics::Mean mean;
    if (env.rank() == 1) {
      const auto values = at::tensor(std::vector<double>{3.5, -2.0, 7.25}, at::kDouble).to(device);
      min.update(values);
      max.update(values);
      mean.update(values);
    }
    min.sync_start(ctx.world());
    max.sync_start(ctx.world());
    mean.sync_start(ctx.world());
    EXPECT_EQ(max.compute_synced(), 7.25);
    EXPECT_EQ(min.compute_synced(), -2.0);
    EXPECT_EQ(mean.compute_synced(), 8.75 / 3);
    // Empty everywhere: NaN after the sync as before it.
    d9d::metrics::Max never;
    never.sync_start(ctx.world());
    EXPECT_TRUE(std::isnan(never.compute_synced()));
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Metrics_Gloo, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "ws" + std::to_string(info.param);
                         });

}  // namespace
