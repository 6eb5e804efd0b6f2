// d9d/metrics/auroc.hpp — binary AUROC from score histograms: mergeable across microbatches and
// ranks by adding histograms.
//
//   d9d::metrics::BinnedAuroc auroc({.num_bins = 1000});
//   auroc.update(probabilities, labels);     // scores in [0, 1], labels 0 / 1, same shape
//   double area = auroc.compute();           // area under the ROC curve of the binned scores
//
// Models d9d::metrics::Metric. State: {positives [num_bins], negatives [num_bins]}, counts of the
// scores of positive / negative samples per bin; a score s falls in bin min(floor(s * num_bins),
// num_bins - 1) (so 1.0 is in the last bin). The value is the Mann-Whitney statistic of the binned
// scores: the fraction of (positive, negative) pairs whose positive lies in a higher bin, plus
// half the pairs sharing a bin, i.e. the trapezoidal area under the ROC curve through the bin
// edges. It equals the exact AUROC when no positive shares a bin with a negative of a different
// score; otherwise it is off by at most half the fraction of pairs sharing a bin. NaN when no
// positive or no negative was seen.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <d9d/metrics/metric.hpp>

namespace d9d::metrics {

/// Knobs of BinnedAuroc; fill with designated initialisers.
struct BinnedAurocOptions {
  /// Bins over [0, 1] (at least 1). More bins: closer to the exact AUROC, larger state.
  int64_t num_bins = 1000;
  /// Check that scores lie in [0, 1] (NaN fails) and labels are 0 or 1: one host synchronisation
  /// per update. Without it, out-of-range scores are clamped into the end bins and a non-zero
  /// label counts as positive.
  bool validate = true;
};

/// Binary AUROC over binned scores (see the file comment).
class BinnedAuroc : public Metric {
 public:
  explicit BinnedAuroc(BinnedAurocOptions options = {});
  /// `scores` (real, in [0, 1]) and `labels` (bool, integer or real 0 / 1) of the same number of
  /// elements. std::invalid_argument naming the sizes or the offending value otherwise.
  void update(const at::Tensor& scores, const at::Tensor& labels);
  [[nodiscard]] double compute() const;
  [[nodiscard]] double compute_synced();
  [[nodiscard]] const BinnedAurocOptions& options() const { return options_; }

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  BinnedAurocOptions options_;
};

}  // namespace d9d::metrics
