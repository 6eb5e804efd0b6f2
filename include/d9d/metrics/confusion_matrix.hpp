// d9d/metrics/confusion_matrix.hpp — the confusion-matrix family: accuracy, per-class precision,
// recall and F1, and their micro and macro averages, from one mergeable C x C count matrix.
//
//   d9d::metrics::ConfusionMatrix cls({.num_classes = 5, .per_class = true});
//   cls.update(logits, labels);              // logits [..., 5] (argmax) or class ids [...]
//   d9d::metrics::ClassificationReport r = cls.compute();   // r.accuracy, r.f1_macro, r.f1[3]...
//
// Models d9d::metrics::Metric. State: {matrix [C, C]}, matrix[t][p] = samples of true class t
// predicted as p. Per class c: tp = matrix[c][c], fp = column c - tp, fn = row c - tp;
// precision = tp / (tp + fp), recall = tp / (tp + fn), F1 = 2 tp / (2 tp + fp + fn), each 0 when
// its denominator is 0 (scikit-learn's zero_division = 0). Micro averages pool tp, fp, fn over
// the classes (for single-label data all three equal the accuracy); macro averages are the mean
// over the classes that occur (tp + fp + fn > 0). Binary task: C = 2 and precision / recall / F1
// are those of the positive class 1. Everything is NaN before the first sample.
//
// values() keys: "accuracy"; binary: "precision", "recall", "f1"; multiclass: "precision_micro",
// "precision_macro", "recall_micro", "recall_macro", "f1_micro", "f1_macro", and with per_class
// "precision/class_<c>", "recall/class_<c>", "f1/class_<c>". The state is C^2 doubles: meant for
// classification heads, not for vocabulary-sized outputs (use Mean of a correctness mask there).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/metrics/metric.hpp>

namespace d9d::metrics {

/// Binary (one score or 0/1 prediction per sample) or multiclass (one of C classes per sample).
enum class ClassificationTask { binary, multiclass };

/// Knobs of ConfusionMatrix; fill with designated initialisers.
struct ConfusionMatrixOptions {
  ClassificationTask task = ClassificationTask::multiclass;
  /// C (at least 2); forced to 2 for the binary task.
  int64_t num_classes = 2;
  /// Binary task, real predictions: predicted positive when score >= threshold.
  double threshold = 0.5;
  /// Samples whose label equals this are skipped (e.g. -100 for padding).
  std::optional<int64_t> ignore_index = std::nullopt;
  /// Multiclass: also report per-class values in values() (3 C keys).
  bool per_class = false;
  /// Check that labels and class-id predictions are in [0, C) (binary: 0 / 1): one host
  /// synchronisation per update. Without it, out-of-range ids are undefined behaviour of bincount.
  bool validate = true;
};

/// Everything the confusion matrix gives (see the file comment for the definitions).
struct ClassificationReport {
  at::Tensor matrix;              ///< [C, C] float64 on cpu
  double samples = 0;             ///< total count
  double accuracy = 0;            ///< trace / total
  std::vector<double> precision;  ///< per class
  std::vector<double> recall;     ///< per class
  std::vector<double> f1;         ///< per class
  std::vector<double> support;    ///< per class: samples whose label is the class
  double precision_micro = 0;
  double recall_micro = 0;
  double f1_micro = 0;
  double precision_macro = 0;
  double recall_macro = 0;
  double f1_macro = 0;
};

/// Counts (label, prediction) pairs in a C x C matrix (see the file comment).
class ConfusionMatrix : public Metric {
 public:
  /// std::invalid_argument for num_classes < 2 (multiclass) or a threshold outside [0, 1].
  explicit ConfusionMatrix(ConfusionMatrixOptions options = {});

  /// Multiclass: `predictions` are class ids of the shape of `labels`, or real scores / logits of
  /// shape labels.shape + [C] (the argmax is taken). Binary: `predictions` are real scores
  /// (thresholded) or 0 / 1 ids, one per label. Labels are integers (binary: also bool).
  /// std::invalid_argument naming the shapes or the offending value for bad input.
  void update(const at::Tensor& predictions, const at::Tensor& labels);

  [[nodiscard]] ClassificationReport compute() const;
  [[nodiscard]] ClassificationReport compute_synced();
  [[nodiscard]] int64_t num_classes() const { return options_.num_classes; }
  [[nodiscard]] const ConfusionMatrixOptions& options() const { return options_; }

  /// The report of a [C, C] count matrix (rows: labels, columns: predictions).
  [[nodiscard]] static ClassificationReport report(const at::Tensor& matrix);

 protected:
  [[nodiscard]] MetricValues values_from(const std::vector<at::Tensor>& state) const override;

 private:
  ConfusionMatrixOptions options_;
};

}  // namespace d9d::metrics
