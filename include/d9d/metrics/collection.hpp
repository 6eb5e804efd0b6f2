// d9d/metrics/collection.hpp — named metrics updated, synced and computed together; one sync is
// one all-reduce for all sum slots (plus one for min and one for max slots, when present).
//
//   d9d::metrics::MetricCollection metrics;
//   auto& cls = metrics.add("cls", d9d::metrics::ConfusionMatrix({.num_classes = 4}));
//   auto& loss = metrics.add("loss", d9d::metrics::Mean{});
//   cls.update(logits, labels); loss.update(losses);      // per microbatch
//   metrics.sync_start(ctx.world());                      // step end
//   metrics.reset();                                      // the next window may start at once
//   d9d::metrics::MetricValues v = metrics.compute_synced();   // log time: {"cls/accuracy", ...}
//
// Keys of compute() / compute_synced(): "<name>" for a metric's single value, "<name>/<key>" for
// its named values (d9d/metrics/confusion_matrix.hpp lists them). Metrics keep insertion order
// and must be added in the same order with the same options on every rank of a synced group.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <d9d/core/process_group.hpp>
#include <d9d/metrics/metric.hpp>

namespace d9d::metrics {

/// Named metrics (see the file comment).
class MetricCollection {
 public:
  MetricCollection() = default;
  ~MetricCollection();
  MetricCollection(MetricCollection&&) noexcept;
  MetricCollection& operator=(MetricCollection&&) noexcept;
  MetricCollection(const MetricCollection&) = delete;
  MetricCollection& operator=(const MetricCollection&) = delete;

  /// Takes `metric` under `name` and returns a reference to it (stable while the collection
  /// lives). std::invalid_argument for an empty name, a name with '/' at either end, or a name
  /// already present.
  template <class M>
  requires std::is_base_of_v<Metric, M> M& add(std::string name, M metric) {
    check_new_name(name);
    auto owned = std::make_unique<M>(std::move(metric));
    M& ref = *owned;
    entries_.push_back({std::move(name), std::move(owned)});
    return ref;
  }

  /// The metric `name` as its kind M. std::out_of_range naming the present metrics when absent,
  /// std::invalid_argument naming both kinds when it is not an M.
  template <class M>
  requires std::is_base_of_v<Metric, M>
  [[nodiscard]] M& get(const std::string& name) {
    Metric& metric = at(name);
    auto* typed = dynamic_cast<M*>(&metric);
    if (typed == nullptr) {
      throw_wrong_kind(name, metric);
    }
    return *typed;
  }

  /// The metric `name`. std::out_of_range naming the present metrics when absent.
  [[nodiscard]] Metric& at(const std::string& name);
  [[nodiscard]] const Metric& at(const std::string& name) const;
  [[nodiscard]] bool contains(const std::string& name) const;
  /// Names in insertion order.
  [[nodiscard]] std::vector<std::string> names() const;
  [[nodiscard]] std::size_t size() const { return entries_.size(); }

  /// Resets every metric (pending syncs and synced snapshots are unaffected).
  void reset();
  /// Launches the all-reduces of a copy of every metric's state: one flat float64 buffer per
  /// reduction kind present. std::logic_error when any metric has a sync pending.
  void sync_start(const ProcessGroup& group);
  /// Completes the pending sync; each metric keeps its global state as its synced snapshot.
  void sync_wait();
  [[nodiscard]] bool sync_pending() const;

  /// Values of the local states, keyed "<name>" / "<name>/<key>".
  [[nodiscard]] MetricValues compute() const;
  /// Values of the synced snapshots (waits for a pending sync). std::logic_error for a metric
  /// never synced.
  [[nodiscard]] MetricValues compute_synced();

 private:
  struct Entry {
    std::string name;
    std::unique_ptr<Metric> metric;
  };
  void check_new_name(const std::string& name) const;
  [[noreturn]] static void throw_wrong_kind(const std::string& name, const Metric& metric);
  static void add_prefixed(MetricValues& out, const std::string& name, const MetricValues& values);

  std::vector<Entry> entries_;
};

}  // namespace d9d::metrics
