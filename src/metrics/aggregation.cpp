// d9d/metrics/aggregation.cpp — Sum, Mean, WeightedMean, Min, Max.
#include <limits>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/metrics/aggregation.hpp>

#include "check.hpp"

namespace d9d::metrics {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using detail::shape_text;

// The flattened input as float64, on its own device. Complex and undefined inputs are refused.
at::Tensor as_values(const at::Tensor& values, const std::string& who) {
  if (!values.defined()) {
    throw std::invalid_argument(who + "::update: undefined tensor");
  }
  if (values.is_complex()) {
    throw std::invalid_argument(who + "::update: complex values are not supported (shape " +
                                shape_text(values) + ")");
  }
  return values.reshape({-1}).to(at::kDouble);
}

// Applies the NaN policy to the flattened values; `keep` (optional out) is the mask of kept
// elements under NanPolicy::ignore.
at::Tensor apply_nan_policy(const at::Tensor& flat, NanPolicy policy, const std::string& who,
                            at::Tensor* keep = nullptr) {
  switch (policy) {
    case NanPolicy::propagate:
      return flat;
    case NanPolicy::error: {
      const auto nans = flat.isnan().sum().item<int64_t>();
      if (nans > 0) {
        throw std::invalid_argument(who + "::update: " + std::to_string(nans) + " NaN of " +
                                    std::to_string(flat.numel()) +
                                    " values (NanPolicy::error); use NanPolicy::ignore to drop "
                                    "them or NanPolicy::propagate to report NaN");
      }
      return flat;
    }
    case NanPolicy::ignore: {
      const auto mask = flat.isnan().logical_not();
      if (keep != nullptr) {
        *keep = mask;
      }
      return flat.masked_select(mask);
    }
  }
  return flat;
}

double scalar(const at::Tensor& tensor) { return tensor.to(at::kCPU).item<double>(); }

// A host value as a float64 scalar on the state's device (no device change for the state).
at::Tensor like_state(double value, const at::Tensor& state) {
  return at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble).device(state.device()));
}

}  // namespace

// ---- Sum ----------------------------------------------------------------------------------------

Sum::Sum(AggregationOptions options) : Metric("d9d::metrics::Sum"), options_(options) {
  add_state("sum", {}, Reduction::sum);
}

void Sum::update(const at::Tensor& values) {
  follow_device(values);
  const auto flat = apply_nan_policy(as_values(values, kind()), options_.nan, kind());
  state(0).add_(flat.sum());
}

void Sum::update(double value) { update(like_state(value, state(0))); }

double Sum::compute() const { return values().at(""); }
double Sum::compute_synced() { return synced_values().at(""); }

MetricValues Sum::values_from(const std::vector<at::Tensor>& state) const {
  return {{"", scalar(state[0])}};
}

// ---- Mean ---------------------------------------------------------------------------------------

Mean::Mean(AggregationOptions options) : Metric("d9d::metrics::Mean"), options_(options) {
  add_state("sum", {}, Reduction::sum);
  add_state("count", {}, Reduction::sum);
}

void Mean::update(const at::Tensor& values) {
  follow_device(values);
  const auto flat = apply_nan_policy(as_values(values, kind()), options_.nan, kind());
  state(0).add_(flat.sum());
  state(1).add_(static_cast<double>(flat.numel()));
}

void Mean::update(double value) { update(like_state(value, state(0))); }

double Mean::compute() const { return values().at(""); }
double Mean::compute_synced() { return synced_values().at(""); }

MetricValues Mean::values_from(const std::vector<at::Tensor>& state) const {
  const double count = scalar(state[1]);
  return {{"", count > 0 ? scalar(state[0]) / count : kNaN}};
}

// ---- WeightedMean -------------------------------------------------------------------------------

WeightedMean::WeightedMean(AggregationOptions options)
    : Metric("d9d::metrics::WeightedMean"), options_(options) {
  add_state("weighted_sum", {}, Reduction::sum);
  add_state("weight", {}, Reduction::sum);
}

void WeightedMean::update(const at::Tensor& values, const at::Tensor& weights) {
  follow_device(values);
  if (!weights.defined()) {
    throw std::invalid_argument(kind() + "::update: undefined weights");
  }
  if (weights.numel() != 1 && weights.sizes() != values.sizes()) {
    throw std::invalid_argument(kind() + "::update: weights of shape " + shape_text(weights) +
                                " for values of shape " + shape_text(values) +
                                "; pass one weight per value (the same shape) or a single weight");
  }
  auto flat = as_values(values, kind());
  auto w = as_values(weights, kind()).to(flat.device());
  if (w.numel() == 1 && flat.numel() != 1) {
    w = w.expand({flat.numel()});
  }
  if (options_.nan == NanPolicy::ignore) {
    const auto keep = flat.isnan().logical_or(w.isnan()).logical_not();
    flat = flat.masked_select(keep);
    w = w.masked_select(keep);
  } else if (options_.nan == NanPolicy::error) {
    (void)apply_nan_policy(at::cat({flat, w}), NanPolicy::error, kind());
  }
  state(0).add_((flat * w).sum());
  state(1).add_(w.sum());
}

void WeightedMean::update(double value, double weight) {
  update(like_state(value, state(0)), like_state(weight, state(0)));
}

double WeightedMean::compute() const { return values().at(""); }
double WeightedMean::compute_synced() { return synced_values().at(""); }

MetricValues WeightedMean::values_from(const std::vector<at::Tensor>& state) const {
  const double weight = scalar(state[1]);
  return {{"", weight != 0 ? scalar(state[0]) / weight : kNaN}};
}

// ---- Min / Max ----------------------------------------------------------------------------------

namespace {

// State of Min / Max: {extreme, count, nan_count}.
void update_extreme(at::Tensor& extreme, at::Tensor& count, at::Tensor& nan_count,
                    const at::Tensor& values, NanPolicy policy, bool is_min,
                    const std::string& who) {
  auto flat = as_values(values, who);
  if (policy == NanPolicy::propagate) {
    const auto nan = flat.isnan();
    nan_count.add_(nan.sum());
    flat = flat.masked_select(nan.logical_not());
  } else {
    flat = apply_nan_policy(flat, policy, who);
  }
  count.add_(static_cast<double>(flat.numel()));
  if (flat.numel() > 0) {
    extreme.copy_(is_min ? at::minimum(extreme, flat.min()) : at::maximum(extreme, flat.max()));
  }
}

MetricValues extreme_values(const std::vector<at::Tensor>& state) {
  if (scalar(state[2]) > 0 || scalar(state[1]) == 0) {
    return {{"", kNaN}};
  }
  return {{"", scalar(state[0])}};
}

}  // namespace

Min::Min(AggregationOptions options) : Metric("d9d::metrics::Min"), options_(options) {
  add_state("min", {}, Reduction::min);
  add_state("count", {}, Reduction::sum);
  add_state("nan_count", {}, Reduction::sum);
}

void Min::update(const at::Tensor& values) {
  follow_device(values);
  update_extreme(state(0), state(1), state(2), values, options_.nan, /*is_min=*/true, kind());
}

void Min::update(double value) { update(like_state(value, state(0))); }
double Min::compute() const { return values().at(""); }
double Min::compute_synced() { return synced_values().at(""); }
MetricValues Min::values_from(const std::vector<at::Tensor>& state) const {
  return extreme_values(state);
}

Max::Max(AggregationOptions options) : Metric("d9d::metrics::Max"), options_(options) {
  add_state("max", {}, Reduction::max);
  add_state("count", {}, Reduction::sum);
  add_state("nan_count", {}, Reduction::sum);
}

void Max::update(const at::Tensor& values) {
  follow_device(values);
  update_extreme(state(0), state(1), state(2), values, options_.nan, /*is_min=*/false, kind());
}

void Max::update(double value) { update(like_state(value, state(0))); }
double Max::compute() const { return values().at(""); }
double Max::compute_synced() { return synced_values().at(""); }
MetricValues Max::values_from(const std::vector<at::Tensor>& state) const {
  return extreme_values(state);
}

}  // namespace d9d::metrics
