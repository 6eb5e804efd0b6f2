// Unit tests of d9d::metrics (include/d9d/metrics): every metric against a direct formula over the
// same data (host loops, no metric code), the error messages, the collection and the track adapter.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/metrics/aggregation.hpp>
#include <d9d/metrics/auroc.hpp>
#include <d9d/metrics/collection.hpp>
#include <d9d/metrics/confusion_matrix.hpp>
#include <d9d/metrics/track.hpp>

namespace {

using d9d::metrics::NanPolicy;
using ::testing::HasSubstr;

constexpr double kEps = std::numeric_limits<double>::epsilon();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

at::Tensor doubles(const std::vector<double>& values) { return at::tensor(values, at::kDouble); }
at::Tensor longs(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

std::vector<double> random_values(std::size_t n, unsigned seed, double lo = -3, double hi = 5) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> out(n);
  for (auto& x : out) {
    x = dist(gen);
  }
  return out;
}

// Feeds `values` to `update` in microbatches of uneven sizes (7, 1, 13, 0, 7, 1, 13, 0, ...).
template <class Update>
void in_microbatches(const std::vector<double>& values, Update update) {
  const std::size_t sizes[] = {7, 1, 13, 0};
  std::size_t at = 0;
  for (std::size_t i = 0; at < values.size(); ++i) {
    const auto n = std::min(sizes[i % 4], values.size() - at);
    update(at, n);
    at += n;
  }
}

// The bound on the difference of two float64 sums of the same n terms in different orders:
// each is within (n - 1) u sum|x| of the exact sum (u = eps / 2), so together n eps sum|x|.
double sum_tolerance(const std::vector<double>& values) {
  double abs_sum = 0;
  for (const auto x : values) {
    abs_sum += std::abs(x);
  }
  return static_cast<double>(values.size()) * kEps * abs_sum;
}

// ------------------------------------------------------------------------------------------------
// Aggregations

TEST(Metrics_Sum, MatchesDirectSumOverMicrobatches) {
  const auto values = random_values(500, 1);
  d9d::metrics::Sum sum;
  in_microbatches(values, [&](std::size_t at, std::size_t n) {
    sum.update(doubles(values).narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(n)));
  });
  double direct = 0;
  for (const auto x : values) {
    direct += x;
  }
  EXPECT_NEAR(sum.compute(), direct, sum_tolerance(values));
  EXPECT_EQ(sum.values().at(""), sum.compute());

  // Any real or integer dtype, any shape; host scalars.
  d9d::metrics::Sum mixed;
  mixed.update(at::arange(6, at::kInt).reshape({2, 3}));  // 15
  mixed.update(at::full({2, 2}, 0.5, at::kFloat));        // 2
  mixed.update(3.0);
  EXPECT_EQ(mixed.compute(), 20.0);
  mixed.reset();
  EXPECT_EQ(mixed.compute(), 0.0);
}

TEST(Metrics_Mean, MatchesDirectMean) {
  const auto values = random_values(300, 2);
  d9d::metrics::Mean mean;
  EXPECT_TRUE(std::isnan(mean.compute()));  // nothing seen yet
  in_microbatches(values, [&](std::size_t at, std::size_t n) {
    mean.update(doubles(values).narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(n)));
  });
  double direct = 0;
  for (const auto x : values) {
    direct += x;
  }
  direct /= static_cast<double>(values.size());
  EXPECT_NEAR(mean.compute(), direct, sum_tolerance(values) / static_cast<double>(values.size()));
  EXPECT_EQ(mean.state()[1].item<double>(), 300.0);  // the count is exact
}

TEST(Metrics_WeightedMean, MatchesDirectFormula) {
  const auto values = random_values(400, 3);
  const auto weights = random_values(400, 4, 0.0, 2.0);
  d9d::metrics::WeightedMean mean;
  in_microbatches(values, [&](std::size_t at, std::size_t n) {
    const auto a = static_cast<int64_t>(at);
    const auto b = static_cast<int64_t>(n);
    mean.update(doubles(values).narrow(0, a, b), doubles(weights).narrow(0, a, b));
  });
  double weighted = 0;
  double weight = 0;
  double abs_weighted = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    weighted += values[i] * weights[i];
    abs_weighted += std::abs(values[i] * weights[i]);
    weight += weights[i];
  }
  const double direct = weighted / weight;
  const double tolerance = static_cast<double>(values.size()) * kEps *
                           (abs_weighted + std::abs(direct) * weight) / weight;
  EXPECT_NEAR(mean.compute(), direct, tolerance);

  // One weight for many values; host scalars.
  d9d::metrics::WeightedMean scalar_weight;
  scalar_weight.update(doubles({1, 2, 3}), doubles({2}));  // 12 / 6
  scalar_weight.update(10.0, 4.0);                         // + 40 / 4
  EXPECT_EQ(scalar_weight.compute(), 52.0 / 10.0);

  d9d::metrics::WeightedMean empty;
  empty.update(doubles({1, 2}), doubles({0, 0}));
  EXPECT_TRUE(std::isnan(empty.compute()));
}

TEST(Metrics_WeightedMean, ShapeMismatchNamesBothShapes) {
  d9d::metrics::WeightedMean mean;
  try {
    mean.update(at::zeros({2, 3}), at::ones({3, 2}));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("weights of shape [3, 2] for values of shape [2, 3]"));
  }
}

TEST(Metrics_MinMax, MatchDirectExtremes) {
  const auto values = random_values(200, 5);
  d9d::metrics::Min min;
  d9d::metrics::Max max;
  EXPECT_TRUE(std::isnan(min.compute()));
  EXPECT_TRUE(std::isnan(max.compute()));
  in_microbatches(values, [&](std::size_t at, std::size_t n) {
    const auto part = doubles(values).narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(n));
    min.update(part);
    max.update(part);
  });
  EXPECT_EQ(min.compute(), *std::min_element(values.begin(), values.end()));
  EXPECT_EQ(max.compute(), *std::max_element(values.begin(), values.end()));
  EXPECT_EQ(min.slots()[0].reduction, d9d::metrics::Reduction::min);
  EXPECT_EQ(max.slots()[0].reduction, d9d::metrics::Reduction::max);
}

TEST(Metrics_NanPolicy, PropagateIgnoreError) {
  const auto with_nan = doubles({1.0, kNaN, 3.0});

  d9d::metrics::Mean propagate;
  propagate.update(with_nan);
  EXPECT_TRUE(std::isnan(propagate.compute()));
  d9d::metrics::Mean ignore({.nan = NanPolicy::ignore});
  ignore.update(with_nan);
  EXPECT_EQ(ignore.compute(), 2.0);
  d9d::metrics::Sum error({.nan = NanPolicy::error});
  try {
    error.update(with_nan);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("1 NaN of 3 values"));
  }
  EXPECT_EQ(error.compute(), 0.0);  // nothing was added

  d9d::metrics::Min min_propagate;
  min_propagate.update(with_nan);
  EXPECT_TRUE(std::isnan(min_propagate.compute()));
  d9d::metrics::Max max_ignore({.nan = NanPolicy::ignore});
  max_ignore.update(with_nan);
  EXPECT_EQ(max_ignore.compute(), 3.0);

  // WeightedMean ignores a pair when its value or its weight is NaN.
  d9d::metrics::WeightedMean weighted({.nan = NanPolicy::ignore});
  weighted.update(doubles({1.0, kNaN, 3.0}), doubles({1.0, 1.0, kNaN}));
  EXPECT_EQ(weighted.compute(), 1.0);
}

TEST(Metrics_Merge, MergedStatesEqualOneMetricOverAllData) {
  const auto values = random_values(100, 6);
  const auto all = doubles(values);
  d9d::metrics::Mean whole;
  d9d::metrics::Mean first;
  d9d::metrics::Mean second;
  whole.update(all);
  first.update(all.narrow(0, 0, 40));
  second.update(all.narrow(0, 40, 60));
  first.merge(second);
  EXPECT_NEAR(first.compute(), whole.compute(), sum_tolerance(values) / 100.0);

  d9d::metrics::Max a;
  d9d::metrics::Max b;
  a.update(doubles({1, 5}));
  b.update(doubles({7}));
  a.merge(b);
  EXPECT_EQ(a.compute(), 7.0);

  try {
    a.merge(whole);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("d9d::metrics::Max::merge: the other metric is a "
                                    "d9d::metrics::Mean"));
  }
}

// ------------------------------------------------------------------------------------------------
// BinnedAuroc

// The exact AUROC: the Mann-Whitney statistic over every (positive, negative) pair, ties 1/2.
double mann_whitney(const std::vector<double>& scores, const std::vector<int64_t>& labels) {
  double greater = 0;
  double equal = 0;
  double positives = 0;
  double negatives = 0;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    (labels[i] != 0 ? positives : negatives) += 1;
    if (labels[i] == 0) {
      continue;
    }
    for (std::size_t j = 0; j < scores.size(); ++j) {
      if (labels[j] == 0) {
        greater += scores[i] > scores[j] ? 1 : 0;
        equal += scores[i] == scores[j] ? 1 : 0;
      }
    }
  }
  return (2 * greater + equal) / (2 * positives * negatives);
}

TEST(Metrics_BinnedAuroc_bins1000, EqualsMannWhitneyExactly) {
  // Scores at bin centres: two scores share a bin only when they are equal, so the binned value
  // is the exact statistic (ties included), bit for bit.
  std::mt19937_64 gen(7);
  std::uniform_int_distribution<int> bin(0, 999);
  std::bernoulli_distribution positive(0.3);
  std::vector<double> scores(600);
  std::vector<int64_t> labels(600);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    labels[i] = positive(gen) ? 1 : 0;
    // Positives score higher on average, with overlap.
    const int b = std::min(999, bin(gen) / (labels[i] != 0 ? 1 : 2) + (labels[i] != 0 ? 100 : 0));
    scores[i] = (b + 0.5) / 1000.0;
  }
  d9d::metrics::BinnedAuroc auroc({.num_bins = 1000});
  in_microbatches(scores, [&](std::size_t at, std::size_t n) {
    const auto a = static_cast<int64_t>(at);
    const auto b = static_cast<int64_t>(n);
    auroc.update(doubles(scores).narrow(0, a, b), longs(labels).narrow(0, a, b));
  });
  const double exact = mann_whitney(scores, labels);
  EXPECT_GT(exact, 0.6);
  EXPECT_LT(exact, 0.95);
  EXPECT_EQ(auroc.compute(), exact);
}

TEST(Metrics_BinnedAuroc_bins10, WithinHalfTheSharedBinPairsOfExact) {
  // Continuous scores in 10 bins: the binned value counts pairs sharing a bin as ties, so it is
  // within half the fraction of such pairs of the exact statistic.
  const auto scores = random_values(300, 8, 0.0, 1.0);
  std::vector<int64_t> labels(scores.size());
  std::mt19937_64 gen(9);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    labels[i] = std::bernoulli_distribution(0.2 + 0.6 * scores[i])(gen) ? 1 : 0;
  }
  d9d::metrics::BinnedAuroc auroc({.num_bins = 10});
  auroc.update(doubles(scores), longs(labels).to(at::kBool));
  double shared = 0;
  double pairs = 0;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    for (std::size_t j = 0; j < scores.size(); ++j) {
      if (labels[i] != 0 && labels[j] == 0) {
        pairs += 1;
        shared += std::floor(scores[i] * 10) == std::floor(scores[j] * 10) ? 1 : 0;
      }
    }
  }
  EXPECT_NEAR(auroc.compute(), mann_whitney(scores, labels), 0.5 * shared / pairs + 1e-15);
}

TEST(Metrics_BinnedAuroc, EdgeCases) {
  d9d::metrics::BinnedAuroc perfect({.num_bins = 100});
  perfect.update(doubles({0.1, 0.2, 0.9, 1.0}), longs({0, 0, 1, 1}));  // 1.0: the last bin
  EXPECT_EQ(perfect.compute(), 1.0);
  d9d::metrics::BinnedAuroc reversed({.num_bins = 100});
  reversed.update(doubles({0.9, 0.8, 0.1, 0.0}), doubles({0, 0, 1, 1}));
  EXPECT_EQ(reversed.compute(), 0.0);
  d9d::metrics::BinnedAuroc tied({.num_bins = 100});
  tied.update(doubles({0.5, 0.5}), longs({0, 1}));
  EXPECT_EQ(tied.compute(), 0.5);
  d9d::metrics::BinnedAuroc one_class({.num_bins = 100});
  one_class.update(doubles({0.5, 0.7}), longs({1, 1}));
  EXPECT_TRUE(std::isnan(one_class.compute()));
}

TEST(Metrics_BinnedAuroc, BadInputIsRefusedWithSizesAndValues) {
  d9d::metrics::BinnedAuroc auroc({.num_bins = 10});
  const auto message = [&](const at::Tensor& scores, const at::Tensor& labels) -> std::string {
    try {
      auroc.update(scores, labels);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(message(doubles({0.1, 0.2, 0.3}), longs({0, 1})),
              HasSubstr("3 scores (shape [3]) but 2 labels (shape [2])"));
  EXPECT_THAT(message(doubles({0.1, 1.5, -2}), longs({0, 1, 1})),
              HasSubstr("2 of 3 scores outside [0, 1] (first: 1.5)"));
  EXPECT_THAT(message(doubles({0.1, kNaN}), longs({0, 1})),
              HasSubstr("1 of 2 scores outside [0, 1] (first: nan)"));
  EXPECT_THAT(message(doubles({0.1, 0.2}), longs({0, 2})),
              HasSubstr("1 of 2 labels are neither 0 nor 1 (first: 2)"));
  EXPECT_THAT(message(longs({0, 1}), longs({0, 1})), HasSubstr("scores must be real"));
  EXPECT_THROW((void)d9d::metrics::BinnedAuroc({.num_bins = 0}), std::invalid_argument);
  // Nothing of the refused updates was counted.
  EXPECT_EQ(auroc.state()[0].sum().item<double>() + auroc.state()[1].sum().item<double>(), 0.0);
}

// ------------------------------------------------------------------------------------------------
// ConfusionMatrix

// labels [0,0,0,0,1,1,2,2,2,2], predictions [0,0,1,2,1,1,2,2,0,1]: matrix (rows = labels)
//   [[2, 1, 1],
//    [0, 2, 0],
//    [1, 1, 2]]
// class 0: tp 2, fp 1, fn 2 -> P 2/3, R 1/2, F1 4/7
// class 1: tp 2, fp 2, fn 0 -> P 1/2, R 1,   F1 2/3
// class 2: tp 2, fp 1, fn 2 -> P 2/3, R 1/2, F1 4/7
// accuracy 6/10; macro P 11/18, R 2/3, F1 38/63; micro P = R = F1 = 6/10.
const std::vector<int64_t> kLabels = {0, 0, 0, 0, 1, 1, 2, 2, 2, 2};
const std::vector<int64_t> kPredicted = {0, 0, 1, 2, 1, 1, 2, 2, 0, 1};

void expect_hand_computed(const d9d::metrics::ClassificationReport& r) {
  EXPECT_EQ(r.samples, 10.0);
  EXPECT_DOUBLE_EQ(r.accuracy, 0.6);
  EXPECT_DOUBLE_EQ(r.precision[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.recall[0], 0.5);
  EXPECT_DOUBLE_EQ(r.f1[0], 4.0 / 7);
  EXPECT_DOUBLE_EQ(r.precision[1], 0.5);
  EXPECT_DOUBLE_EQ(r.recall[1], 1.0);
  EXPECT_DOUBLE_EQ(r.f1[1], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.precision[2], 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.recall[2], 0.5);
  EXPECT_DOUBLE_EQ(r.f1[2], 4.0 / 7);
  EXPECT_DOUBLE_EQ(r.precision_macro, 11.0 / 18);
  EXPECT_DOUBLE_EQ(r.recall_macro, 2.0 / 3);
  EXPECT_DOUBLE_EQ(r.f1_macro, 38.0 / 63);
  EXPECT_DOUBLE_EQ(r.precision_micro, 0.6);
  EXPECT_DOUBLE_EQ(r.recall_micro, 0.6);
  EXPECT_DOUBLE_EQ(r.f1_micro, 0.6);
  EXPECT_EQ(std::vector<double>(r.support.begin(), r.support.begin() + 3),
            (std::vector<double>{4, 2, 4}));
}

TEST(Metrics_ConfusionMatrix_c3, HandComputedReportFromClassIds) {
  d9d::metrics::ConfusionMatrix cm({.num_classes = 3, .per_class = true});
  cm.update(longs(kPredicted).narrow(0, 0, 6), longs(kLabels).narrow(0, 0, 6));
  cm.update(longs(kPredicted).narrow(0, 6, 4), longs(kLabels).narrow(0, 6, 4));
  const auto r = cm.compute();
  EXPECT_TRUE(at::equal(r.matrix, doubles({2, 1, 1, 0, 2, 0, 1, 1, 2}).reshape({3, 3})));
  expect_hand_computed(r);

  const auto v = cm.values();
  EXPECT_DOUBLE_EQ(v.at("f1_macro"), 38.0 / 63);
  EXPECT_DOUBLE_EQ(v.at("precision/class_1"), 0.5);
  EXPECT_DOUBLE_EQ(v.at("recall/class_1"), 1.0);
  EXPECT_DOUBLE_EQ(v.at("f1/class_2"), 4.0 / 7);
  EXPECT_EQ(v.size(), 7U + 9U);
}

TEST(Metrics_ConfusionMatrix_c3, LogitsTakeTheArgmax) {
  // Logits [2, 5, 3] whose argmax is kPredicted.
  auto logits = at::randn({2, 5, 3}, at::kFloat);
  const auto ids = longs(kPredicted).reshape({2, 5});
  logits.scatter_(2, ids.unsqueeze(-1), 100.0);
  d9d::metrics::ConfusionMatrix cm({.num_classes = 3});
  cm.update(logits, longs(kLabels).reshape({2, 5}));
  expect_hand_computed(cm.compute());
  EXPECT_EQ(cm.values().size(), 7U);  // no per-class keys by default
}

TEST(Metrics_ConfusionMatrix_c4, AbsentClassIsLeftOutOfMacroAverages) {
  // Class 3 never occurs (no label, no prediction): per-class 0, and the macro averages are the
  // three-class ones.
  d9d::metrics::ConfusionMatrix cm({.num_classes = 4});
  cm.update(longs(kPredicted), longs(kLabels));
  const auto r = cm.compute();
  expect_hand_computed(r);
  EXPECT_EQ(r.f1[3], 0.0);
  EXPECT_EQ(r.precision[3], 0.0);
}

TEST(Metrics_ConfusionMatrix_c7, RandomDataMatchesDirectCounts) {
  constexpr int64_t kClasses = 7;
  std::mt19937_64 gen(10);
  std::uniform_int_distribution<int64_t> cls(0, kClasses - 1);
  std::bernoulli_distribution right(0.55);
  std::vector<int64_t> labels(2000);
  std::vector<int64_t> predicted(2000);
  for (std::size_t i = 0; i < labels.size(); ++i) {
    labels[i] = cls(gen);
    predicted[i] = right(gen) ? labels[i] : cls(gen);
  }
  d9d::metrics::ConfusionMatrix cm({.num_classes = kClasses, .per_class = true});
  for (int64_t at = 0; at < 2000; at += 256) {
    const auto n = std::min<int64_t>(256, 2000 - at);
    cm.update(longs(predicted).narrow(0, at, n), longs(labels).narrow(0, at, n));
  }
  const auto r = cm.compute();
  double correct = 0;
  double macro_f1 = 0;
  for (int64_t c = 0; c < kClasses; ++c) {
    double tp = 0;
    double fp = 0;
    double fn = 0;
    for (std::size_t i = 0; i < labels.size(); ++i) {
      tp += (labels[i] == c && predicted[i] == c) ? 1 : 0;
      fp += (labels[i] != c && predicted[i] == c) ? 1 : 0;
      fn += (labels[i] == c && predicted[i] != c) ? 1 : 0;
    }
    correct += tp;
    const auto k = static_cast<std::size_t>(c);
    EXPECT_EQ(r.precision[k], tp / (tp + fp)) << "class " << c;
    EXPECT_EQ(r.recall[k], tp / (tp + fn)) << "class " << c;
    EXPECT_EQ(r.f1[k], 2 * tp / (2 * tp + fp + fn)) << "class " << c;
    macro_f1 += 2 * tp / (2 * tp + fp + fn);
  }
  EXPECT_EQ(r.accuracy, correct / 2000);
  EXPECT_EQ(r.f1_micro, correct / 2000);
  EXPECT_NEAR(r.f1_macro, macro_f1 / kClasses, 4 * kEps);
}

TEST(Metrics_ConfusionMatrix_binary, ThresholdAndPositiveClass) {
  // scores >= 0.5 are positive: predicted [1, 0, 1, 1, 0, 0], labels [1, 1, 0, 1, 0, 0]
  // tp 2, fp 1, fn 1, tn 2 -> precision 2/3, recall 2/3, f1 2/3, accuracy 4/6.
  d9d::metrics::ConfusionMatrix cm({.task = d9d::metrics::ClassificationTask::binary});
  cm.update(doubles({0.9, 0.2, 0.5, 0.7, 0.49, 0.0}),
            at::tensor(std::vector<int64_t>{1, 1, 0, 1, 0, 0}).to(at::kBool));
  const auto v = cm.values();
  EXPECT_EQ(v.size(), 4U);
  EXPECT_DOUBLE_EQ(v.at("accuracy"), 4.0 / 6);
  EXPECT_DOUBLE_EQ(v.at("precision"), 2.0 / 3);
  EXPECT_DOUBLE_EQ(v.at("recall"), 2.0 / 3);
  EXPECT_DOUBLE_EQ(v.at("f1"), 2.0 / 3);

  d9d::metrics::ConfusionMatrix strict(
      {.task = d9d::metrics::ClassificationTask::binary, .threshold = 0.8});
  strict.update(doubles({0.9, 0.7}), longs({1, 1}));
  EXPECT_DOUBLE_EQ(strict.values().at("recall"), 0.5);
}

TEST(Metrics_ConfusionMatrix, IgnoreIndexSkipsSamples) {
  d9d::metrics::ConfusionMatrix cm({.num_classes = 3, .ignore_index = -100});
  cm.update(longs({0, 1, 2, 2}), longs({0, -100, 2, -100}));
  const auto r = cm.compute();
  EXPECT_EQ(r.samples, 2.0);
  EXPECT_EQ(r.accuracy, 1.0);
  d9d::metrics::ConfusionMatrix empty({.num_classes = 3});
  EXPECT_TRUE(std::isnan(empty.compute().accuracy));
  EXPECT_TRUE(std::isnan(empty.values().at("f1_macro")));
}

TEST(Metrics_ConfusionMatrix, BadInputIsRefusedWithSizesAndValues) {
  d9d::metrics::ConfusionMatrix cm({.num_classes = 3});
  const auto message = [&](const at::Tensor& predictions, const at::Tensor& labels) -> std::string {
    try {
      cm.update(predictions, labels);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(message(longs({0, 1, 2}), longs({0, 3, 5})),
              HasSubstr("2 of 3 labels are outside [0, 3) (first: 3)"));
  EXPECT_THAT(message(longs({0, -1}), longs({0, 1})),
              HasSubstr("1 of 2 predicted class ids are outside [0, 3) (first: -1)"));
  EXPECT_THAT(message(at::zeros({4, 2}), longs({0, 1, 2, 0})),
              HasSubstr("scores of shape [4, 2] for labels of shape [4]; expected labels.shape + "
                        "[3]"));
  EXPECT_THAT(message(longs({0, 1, 2}), longs({0, 1})),
              HasSubstr("3 predictions (shape [3]) for 2 labels (shape [2])"));
  EXPECT_THAT(message(longs({0, 1}), doubles({0, 1})), HasSubstr("labels must be integer"));
  EXPECT_EQ(cm.state()[0].sum().item<double>(), 0.0);
  EXPECT_THROW((void)d9d::metrics::ConfusionMatrix({.num_classes = 1}), std::invalid_argument);
}

// ------------------------------------------------------------------------------------------------
// MetricCollection and sync on a group of one rank

TEST(Metrics_Collection, NamesKeysAndLookups) {
  d9d::metrics::MetricCollection metrics;
  auto& cls = metrics.add("cls", d9d::metrics::ConfusionMatrix({.num_classes = 3}));
  auto& loss = metrics.add("loss", d9d::metrics::Mean{});
  cls.update(longs(kPredicted), longs(kLabels));
  loss.update(doubles({1, 2, 3}));
  EXPECT_EQ(metrics.names(), (std::vector<std::string>{"cls", "loss"}));
  EXPECT_EQ(&metrics.get<d9d::metrics::Mean>("loss"), &loss);

  const auto v = metrics.compute();
  EXPECT_EQ(v.size(), 8U);
  EXPECT_EQ(v.at("loss"), 2.0);
  EXPECT_DOUBLE_EQ(v.at("cls/f1_macro"), 38.0 / 63);
  EXPECT_DOUBLE_EQ(v.at("cls/accuracy"), 0.6);

  EXPECT_THROW(metrics.add("loss", d9d::metrics::Sum{}), std::invalid_argument);
  EXPECT_THROW(metrics.add("", d9d::metrics::Sum{}), std::invalid_argument);
  try {
    (void)metrics.get<d9d::metrics::Sum>("loss");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("'loss' is a d9d::metrics::Mean"));
  }
  try {
    (void)metrics.at("acc");
    FAIL() << "expected std::out_of_range";
  } catch (const std::out_of_range& e) {
    EXPECT_THAT(e.what(), HasSubstr("no metric named 'acc' (present: cls, loss)"));
  }
}

TEST(Metrics_Collection, SyncSnapshotsTheStateAtSyncStart) {
  d9d::metrics::MetricCollection metrics;
  auto& sum = metrics.add("sum", d9d::metrics::Sum{});
  auto& max = metrics.add("max", d9d::metrics::Max{});
  EXPECT_THROW((void)metrics.compute_synced(), std::logic_error);  // never synced
  sum.update(doubles({1, 2}));
  max.update(doubles({4, -1}));
  const d9d::ProcessGroup local;  // a group of one: nothing is communicated
  metrics.sync_start(local);
  EXPECT_TRUE(metrics.sync_pending());
  EXPECT_THROW(metrics.sync_start(local), std::logic_error);
  // The next window starts at once; the snapshot keeps the state at sync_start.
  metrics.reset();
  sum.update(10.0);
  EXPECT_EQ(metrics.compute_synced(), (d9d::metrics::MetricValues{{"sum", 3.0}, {"max", 4.0}}));
  EXPECT_FALSE(metrics.sync_pending());
  EXPECT_EQ(sum.compute(), 10.0);
  EXPECT_EQ(sum.compute_synced(), 3.0);
  EXPECT_TRUE(std::isnan(max.compute()));

  // A metric synced on its own.
  d9d::metrics::Mean mean;
  mean.update(doubles({2, 4}));
  EXPECT_FALSE(mean.has_synced());
  mean.sync_start(local);
  mean.sync_wait();
  EXPECT_EQ(mean.compute_synced(), 3.0);
}

// ------------------------------------------------------------------------------------------------
// Track adapter

std::string scratch_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base != nullptr ? base : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0777);
  return dir;
}

TEST(Metrics_Track, WritesJsonlAndTensorBoard) {
  const auto dir = scratch_dir("metrics_track");
  d9d::metrics::MetricCollection metrics;
  metrics.add("cls", d9d::metrics::ConfusionMatrix({.num_classes = 3}))
      .update(longs(kPredicted), longs(kLabels));
  metrics.add("loss", d9d::metrics::Mean{}).update(doubles({0.5, 1.5}));
  {
    d9d::track::JsonlWriter jsonl(dir + "/metrics.jsonl");
    d9d::track::TensorBoardWriter tb(dir + "/tb");
    d9d::metrics::write_values(7, metrics.compute(),
                               {.jsonl = &jsonl, .tensorboard = &tb, .prefix = "eval/"});
    struct stat info {};
    ASSERT_EQ(::stat(tb.path().c_str(), &info), 0);
  }
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_THAT(line, HasSubstr(R"({"step":7,)"));
  EXPECT_THAT(line, HasSubstr(R"("eval/cls/accuracy":0.6,)"));
  EXPECT_THAT(line, HasSubstr(R"("eval/loss":1.0})"));

  EXPECT_EQ(d9d::metrics::to_scalars({{"", 1.0}}, "eval/"),
            (std::vector<std::pair<std::string, double>>{{"eval", 1.0}}));
  EXPECT_EQ(d9d::metrics::to_scalars({{"", 1.0}}, ""),
            (std::vector<std::pair<std::string, double>>{{"value", 1.0}}));
}

}  // namespace
