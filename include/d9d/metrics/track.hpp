// d9d/metrics/track.hpp — writes metric values through the d9d::track writers, like the loss.
//
//   d9d::track::JsonlWriter jsonl(dir + "/metrics.jsonl");
//   d9d::track::TensorBoardWriter tb(dir);
//   d9d::metrics::write_values(step, metrics.compute_synced(),
//                              {.jsonl = &jsonl, .tensorboard = &tb, .prefix = "eval/"});
//
// Keys become "<prefix><key>" in both files, in the map's (sorted) order; NaN is written as the
// writers write it (null in JSONL, NaN in TensorBoard). Call it on the main rank only.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <d9d/metrics/metric.hpp>
#include <d9d/track/jsonl.hpp>
#include <d9d/track/tensorboard.hpp>

namespace d9d::metrics {

/// Where write_values writes; null writers are skipped.
struct TrackSinks {
  track::JsonlWriter* jsonl = nullptr;
  track::TensorBoardWriter* tensorboard = nullptr;
  /// Prepended to every key, e.g. "train/" or "eval/".
  std::string prefix = {};
};

/// The values as (prefix + key, value) pairs in key order (keys "" become the bare prefix without
/// a trailing '/', or "value" when the prefix is empty).
[[nodiscard]] std::vector<std::pair<std::string, double>> to_scalars(const MetricValues& values,
                                                                     const std::string& prefix);

/// One JSONL line and one TensorBoard event of `values` at `step`.
void write_values(std::int64_t step, const MetricValues& values, const TrackSinks& sinks);

}  // namespace d9d::metrics
