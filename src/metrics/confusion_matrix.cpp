// d9d/metrics/confusion_matrix.cpp — ConfusionMatrix and its classification report.
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/metrics/confusion_matrix.hpp>

#include "check.hpp"

namespace d9d::metrics {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double ratio(double numerator, double denominator) {
  return denominator > 0 ? numerator / denominator : 0.0;
}

ConfusionMatrixOptions normalised(ConfusionMatrixOptions options) {
  if (options.task == ClassificationTask::binary) {
    options.num_classes = 2;
  }
  if (options.num_classes < 2) {
    throw std::invalid_argument(
        "d9d::metrics::ConfusionMatrix: num_classes = " + std::to_string(options.num_classes) +
        "; needs at least 2 (use the binary task for two classes)");
  }
  if (!(options.threshold >= 0 && options.threshold <= 1)) {
    throw std::invalid_argument("d9d::metrics::ConfusionMatrix: threshold = " +
                                std::to_string(options.threshold) + "; needs a value in [0, 1]");
  }
  return options;
}

// Throws when any id is outside [0, classes): names the count, the first offender and the range.
void check_ids(const at::Tensor& ids, int64_t classes, const std::string& who, const char* what) {
  if (ids.numel() == 0) {
    return;
  }
  const auto bad = ids.lt(0).logical_or(ids.ge(classes));
  const auto count = bad.sum().item<int64_t>();
  if (count > 0) {
    std::ostringstream msg;
    msg << who << "::update: " << count << " of " << ids.numel() << " " << what << " outside [0, "
        << classes << ") (first: " << ids.masked_select(bad)[0].item<int64_t>() << ")";
    throw std::invalid_argument(msg.str());
  }
}

}  // namespace

ConfusionMatrix::ConfusionMatrix(ConfusionMatrixOptions options)
    : Metric("d9d::metrics::ConfusionMatrix"), options_(normalised(options)) {
  add_state("matrix", {options_.num_classes, options_.num_classes}, Reduction::sum);
}

void ConfusionMatrix::update(const at::Tensor& predictions, const at::Tensor& labels) {
  follow_device(predictions);
  if (!labels.defined()) {
    throw std::invalid_argument(kind() + "::update: undefined labels");
  }
  const int64_t classes = options_.num_classes;
  const bool real_predictions = at::isFloatingType(predictions.scalar_type());
  if (at::isFloatingType(labels.scalar_type()) || labels.is_complex()) {
    throw std::invalid_argument(kind() + "::update: labels must be integer class ids, got dtype " +
                                std::string(c10::toString(labels.scalar_type())));
  }
  at::Tensor predicted;
  if (options_.task == ClassificationTask::multiclass && real_predictions) {
    // Scores / logits of shape labels.shape + [C].
    const bool shape_ok = predictions.dim() == labels.dim() + 1 &&
                          predictions.size(-1) == classes &&
                          predictions.sizes().slice(0, labels.dim()) == labels.sizes();
    if (!shape_ok) {
      throw std::invalid_argument(
          kind() + "::update: scores of shape " + detail::shape_text(predictions) +
          " for labels of shape " + detail::shape_text(labels) + "; expected labels.shape + [" +
          std::to_string(classes) + "] (or class ids of the labels' shape)");
    }
    predicted = predictions.argmax(-1).reshape({-1});
  } else {
    if (predictions.numel() != labels.numel()) {
      throw std::invalid_argument(kind() + "::update: " + std::to_string(predictions.numel()) +
                                  " predictions (shape " + detail::shape_text(predictions) +
                                  ") for " + std::to_string(labels.numel()) + " labels (shape " +
                                  detail::shape_text(labels) + "); pass one per label");
    }
    predicted = real_predictions ? predictions.reshape({-1}).ge(options_.threshold).to(at::kLong)
                                 : predictions.reshape({-1}).to(at::kLong);
  }
  auto truth = labels.reshape({-1}).to(at::kLong).to(predicted.device());
  if (options_.ignore_index) {
    const auto keep = truth.ne(*options_.ignore_index);
    truth = truth.masked_select(keep);
    predicted = predicted.masked_select(keep);
  }
  if (options_.validate) {
    check_ids(truth, classes, kind(), "labels are");
    if (!real_predictions) {
      check_ids(predicted, classes, kind(), "predicted class ids are");
    }
  }
  const auto cells = at::bincount(truth * classes + predicted, {}, classes * classes);
  state(0).add_(cells.to(at::kDouble).reshape({classes, classes}));
}

ClassificationReport ConfusionMatrix::report(const at::Tensor& matrix) {
  ClassificationReport r;
  r.matrix = matrix.to(at::kCPU).to(at::kDouble).contiguous();
  const int64_t classes = r.matrix.size(0);
  const auto m = r.matrix.accessor<double, 2>();
  double trace = 0;
  double total = 0;
  std::vector<double> row(static_cast<std::size_t>(classes), 0.0);
  std::vector<double> column(static_cast<std::size_t>(classes), 0.0);
  for (int64_t t = 0; t < classes; ++t) {
    for (int64_t p = 0; p < classes; ++p) {
      row[static_cast<std::size_t>(t)] += m[t][p];
      column[static_cast<std::size_t>(p)] += m[t][p];
      total += m[t][p];
    }
    trace += m[t][t];
  }
  r.samples = total;
  if (total == 0) {
    r.accuracy = r.precision_micro = r.recall_micro = r.f1_micro = kNaN;
    r.precision_macro = r.recall_macro = r.f1_macro = kNaN;
    r.precision.assign(static_cast<std::size_t>(classes), kNaN);
    r.recall = r.f1 = r.precision;
    r.support.assign(static_cast<std::size_t>(classes), 0.0);
    return r;
  }
  r.accuracy = trace / total;
  double sum_tp = 0;
  double sum_fp = 0;
  double sum_fn = 0;
  double macro_p = 0;
  double macro_r = 0;
  double macro_f = 0;
  int64_t present = 0;
  for (int64_t c = 0; c < classes; ++c) {
    const auto i = static_cast<std::size_t>(c);
    const double tp = m[c][c];
    const double fp = column[i] - tp;
    const double fn = row[i] - tp;
    r.precision.push_back(ratio(tp, tp + fp));
    r.recall.push_back(ratio(tp, tp + fn));
    r.f1.push_back(ratio(2 * tp, 2 * tp + fp + fn));
    r.support.push_back(row[i]);
    sum_tp += tp;
    sum_fp += fp;
    sum_fn += fn;
    if (tp + fp + fn > 0) {
      ++present;
      macro_p += r.precision.back();
      macro_r += r.recall.back();
      macro_f += r.f1.back();
    }
  }
  r.precision_micro = ratio(sum_tp, sum_tp + sum_fp);
  r.recall_micro = ratio(sum_tp, sum_tp + sum_fn);
  r.f1_micro = ratio(2 * sum_tp, 2 * sum_tp + sum_fp + sum_fn);
  const auto n = static_cast<double>(present);
  r.precision_macro = macro_p / n;
  r.recall_macro = macro_r / n;
  r.f1_macro = macro_f / n;
  return r;
}

ClassificationReport ConfusionMatrix::compute() const { return report(state().front()); }
ClassificationReport ConfusionMatrix::compute_synced() { return report(synced_state().front()); }

MetricValues ConfusionMatrix::values_from(const std::vector<at::Tensor>& state) const {
  const auto r = report(state.front());
  MetricValues out{{"accuracy", r.accuracy}};
  if (options_.task == ClassificationTask::binary) {
    out["precision"] = r.precision[1];
    out["recall"] = r.recall[1];
    out["f1"] = r.f1[1];
    return out;
  }
  out["precision_micro"] = r.precision_micro;
  out["precision_macro"] = r.precision_macro;
  out["recall_micro"] = r.recall_micro;
  out["recall_macro"] = r.recall_macro;
  out["f1_micro"] = r.f1_micro;
  out["f1_macro"] = r.f1_macro;
  if (options_.per_class) {
    for (std::size_t c = 0; c < r.precision.size(); ++c) {
      const auto suffix = "/class_" + std::to_string(c);
      out["precision" + suffix] = r.precision[c];
      out["recall" + suffix] = r.recall[c];
      out["f1" + suffix] = r.f1[c];
    }
  }
  return out;
}

}  // namespace d9d::metrics
