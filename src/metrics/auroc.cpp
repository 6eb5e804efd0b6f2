// d9d/metrics/auroc.cpp — BinnedAuroc: positive / negative score histograms.
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/metrics/auroc.hpp>

#include "check.hpp"

namespace d9d::metrics {

BinnedAuroc::BinnedAuroc(BinnedAurocOptions options)
    : Metric("d9d::metrics::BinnedAuroc"), options_(options) {
  if (options_.num_bins < 1) {
    throw std::invalid_argument("d9d::metrics::BinnedAuroc: num_bins = " +
                                std::to_string(options_.num_bins) + "; needs at least 1");
  }
  add_state("positives", {options_.num_bins}, Reduction::sum);
  add_state("negatives", {options_.num_bins}, Reduction::sum);
}

void BinnedAuroc::update(const at::Tensor& scores, const at::Tensor& labels) {
  follow_device(scores);
  if (!labels.defined()) {
    throw std::invalid_argument(kind() + "::update: undefined labels");
  }
  if (scores.numel() != labels.numel()) {
    throw std::invalid_argument(kind() + "::update: " + std::to_string(scores.numel()) +
                                " scores (shape " + detail::shape_text(scores) + ") but " +
                                std::to_string(labels.numel()) + " labels (shape " +
                                detail::shape_text(labels) + "); pass one label per score");
  }
  if (!at::isFloatingType(scores.scalar_type())) {
    throw std::invalid_argument(kind() +
                                "::update: scores must be real (probabilities in [0, 1]), "
                                "got dtype " +
                                std::string(c10::toString(scores.scalar_type())));
  }
  const auto s = scores.reshape({-1}).to(at::kDouble);
  const auto l = labels.reshape({-1}).to(s.device());
  if (options_.validate && s.numel() > 0) {
    const auto bad_scores = s.ge(0).logical_and(s.le(1)).logical_not();
    const auto bad_labels = l.ne(0).logical_and(l.ne(1));
    const auto counts = at::stack({bad_scores.sum(), bad_labels.sum()}).to(at::kCPU);
    const auto n_bad_scores = counts[0].item<int64_t>();
    const auto n_bad_labels = counts[1].item<int64_t>();
    if (n_bad_scores > 0) {
      const auto first = s.masked_select(bad_scores)[0].item<double>();
      std::ostringstream msg;
      msg << kind() << "::update: " << n_bad_scores << " of " << s.numel()
          << " scores outside [0, 1] (first: " << first
          << "); pass probabilities (e.g. sigmoid of the logits); NaN scores are refused";
      throw std::invalid_argument(msg.str());
    }
    if (n_bad_labels > 0) {
      const auto first = l.masked_select(bad_labels)[0].to(at::kDouble).item<double>();
      std::ostringstream msg;
      msg << kind() << "::update: " << n_bad_labels << " of " << l.numel()
          << " labels are neither 0 nor 1 (first: " << first << ")";
      throw std::invalid_argument(msg.str());
    }
  }
  const auto bins = options_.num_bins;
  const auto index =
      (s * static_cast<double>(bins)).floor().clamp(0, static_cast<double>(bins - 1)).to(at::kLong);
  const auto positive = l.ne(0);
  state(0).add_(at::bincount(index.masked_select(positive), {}, bins).to(at::kDouble));
  state(1).add_(
      at::bincount(index.masked_select(positive.logical_not()), {}, bins).to(at::kDouble));
}

double BinnedAuroc::compute() const { return values().at(""); }
double BinnedAuroc::compute_synced() { return synced_values().at(""); }

MetricValues BinnedAuroc::values_from(const std::vector<at::Tensor>& state) const {
  const auto pos = state[0].to(at::kCPU);
  const auto neg = state[1].to(at::kCPU);
  const double total_pos = pos.sum().item<double>();
  const double total_neg = neg.sum().item<double>();
  if (total_pos == 0 || total_neg == 0) {
    return {{"", std::numeric_limits<double>::quiet_NaN()}};
  }
  // Twice the Mann-Whitney U of the bins: 2 * pos[i] * (negatives in lower bins) + pos[i] * neg[i]
  // (integers while counts stay below 2^53, so the quotient is exact to one rounding).
  const auto below = neg.cumsum(0) - neg;
  const double twice_u = (pos * below * 2 + pos * neg).sum().item<double>();
  return {{"", twice_u / (2 * total_pos * total_neg)}};
}

}  // namespace d9d::metrics
