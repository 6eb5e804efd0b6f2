// d9d/metrics/aggregation.hpp — Sum, Mean, WeightedMean, Min and Max of values seen per microbatch.
//
//   d9d::metrics::WeightedMean loss;               // e.g. a per-sequence loss weighted by tokens
//   loss.update(per_seq_loss, tokens_per_seq);      // tensors of one shape, any device
//   double mean = loss.compute();                   // sum(w * x) / sum(w) over every update
//
// Every kind models d9d::metrics::Metric (d9d/metrics/metric.hpp): its state is float64 (sums and
// counts merged by `sum`, the extreme of Min / Max by `min` / `max`), so it merges exactly across
// microbatches and ranks. Inputs may be any real dtype and shape; they are flattened. Values: one,
// under the key "" in values(). Empty: Sum gives 0; Mean, WeightedMean (zero total weight), Min
// and Max give NaN. NaN inputs follow AggregationOptions::nan (d9d::metrics::NanPolicy).
#pragma once

#include <ATen/core/Tensor.h>

#include <d9d/metrics/metric.hpp>

namespace d9d::metrics {

/// Knobs of Sum, Mean, WeightedMean, Min and Max; fill with designated initialisers.
struct AggregationOptions {
  NanPolicy nan = NanPolicy::propagate;
};

/// The sum of every value seen. State: {sum}.
class Sum : public Metric {
 public:
  explicit Sum(AggregationOptions options = {});
  /// Adds the sum of `values` (any shape).
  void update(const at::Tensor& values);
  void update(double value);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  AggregationOptions options_;
};

/// The mean of every value seen (each element counts once). State: {sum, count}.
class Mean : public Metric {
 public:
  explicit Mean(AggregationOptions options = {});
  void update(const at::Tensor& values);
  void update(double value);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  AggregationOptions options_;
};

/// sum(w * x) / sum(w) over every (value, weight) pair seen. State: {weighted_sum, weight}.
/// Weights are not checked for sign; a total weight of 0 gives NaN.
class WeightedMean : public Metric {
 public:
  explicit WeightedMean(AggregationOptions options = {});
  /// `weights` has the shape of `values`, or is a single element applied to all of them.
  /// std::invalid_argument with both shapes otherwise.
  void update(const at::Tensor& values, const at::Tensor& weights);
  void update(double value, double weight);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  AggregationOptions options_;
};

/// The smallest value seen. State: {min (reduced by min), count, nan_count}.
class Min : public Metric {
 public:
  explicit Min(AggregationOptions options = {});
  void update(const at::Tensor& values);
  void update(double value);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  AggregationOptions options_;
};

/// The largest value seen. State: {max (reduced by max), count, nan_count}.
class Max : public Metric {
 public:
  explicit Max(AggregationOptions options = {});
  void update(const at::Tensor& values);
  void update(double value);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  AggregationOptions options_;
};

}  // namespace d9d::metrics
