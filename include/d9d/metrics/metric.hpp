// d9d/metrics/metric.hpp — the base of every metric: mergeable state tensors, reset, merge, and
// an asynchronous all-reduce of the state over a process group.
//
//   d9d::metrics::Mean loss;                       // d9d/metrics/aggregation.hpp
//   loss.update(per_token_loss);                   // per microbatch, on any device
//   loss.sync_start(ctx.world());                  // step end: all-reduce launched, not waited
//   double global = loss.compute_synced();         // log time: waits, value over every rank
//
// A metric's state is a fixed list of small float64 tensors, each with the reduction that merges
// two states: `sum` (counts, sums, histograms, confusion matrices) or `min` / `max`. Counts are
// exact in float64 up to 2^53. The state lives on the device of the last update's inputs (moved
// there when they differ; cpu before the first update).
//
// Sync: sync_start(group) copies the state as it is at that moment into flat buffers (one per
// reduction) and launches their all-reduces; the metric itself stays usable (update or reset it
// at once, e.g. to start the next logging window). sync_wait() completes them and keeps the
// global state as the *synced snapshot*: compute_synced() / synced_values() read it (waiting if a
// sync is still pending), compute() / values() always read the local state. Every rank of the
// group must call sync_start on metrics of the same kinds and options, in the same order.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>

namespace d9d::metrics {

/// How two states of one slot merge (and how the slot is all-reduced).
enum class Reduction { sum, min, max };

/// What an aggregation does with NaN inputs. `propagate`: the value becomes NaN (like the loss in
/// the logs); `ignore`: NaN elements (and their weights) are dropped; `error`: update() throws
/// std::invalid_argument (one host synchronisation per update).
enum class NanPolicy { propagate, ignore, error };

/// Named scalar values, ready for d9d::track writers ("" is the key of a metric's single value).
using MetricValues = std::map<std::string, double>;

namespace detail {
struct PendingSync;
}  // namespace detail

/// The base of every metric. Derived classes register their state in the constructor
/// (add_state), update it, and derive values from a state (values_from).
class Metric {
 public:
  /// One slot of the state: a float64 tensor of a fixed shape merged by `reduction`.
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    Reduction reduction = Reduction::sum;
  };

  virtual ~Metric();
  Metric(Metric&&) noexcept;
  Metric& operator=(Metric&&) noexcept;
  Metric(const Metric&) = delete;
  Metric& operator=(const Metric&) = delete;

  /// Back to the empty state (zeros for sums, +inf for min, -inf for max), on the same device.
  /// A pending sync is unaffected, and so is the synced snapshot.
  void reset();

  /// Adds `other`'s state to this one (sum slots add, min/max slots take the extreme). `other`
  /// must be the same kind with the same options (state shapes); std::invalid_argument otherwise.
  void merge(const Metric& other);

  /// Launches the all-reduce of a copy of the current state over `group` (a group of one rank, or
  /// a default-constructed one, communicates nothing). std::logic_error when a sync is pending.
  void sync_start(const ProcessGroup& group);
  /// Completes the pending sync; the global state becomes the synced snapshot. No-op when none.
  void sync_wait();
  [[nodiscard]] bool sync_pending() const;
  /// Whether a synced snapshot exists (a sync was completed, or is pending).
  [[nodiscard]] bool has_synced() const;

  /// The values of the local state: {"": value} for single-valued metrics, named values otherwise.
  [[nodiscard]] MetricValues values() const;
  /// The values of the synced snapshot (waits for a pending sync). std::logic_error without one.
  [[nodiscard]] MetricValues synced_values();

  /// The state's slots and tensors, in registration order (the same order on every rank).
  [[nodiscard]] const std::vector<Slot>& slots() const { return slots_; }
  [[nodiscard]] const std::vector<at::Tensor>& state() const { return state_; }
  /// The synced snapshot (waits for a pending sync). std::logic_error without one.
  [[nodiscard]] const std::vector<at::Tensor>& synced_state();

  /// A readable name of the metric kind, e.g. "d9d::metrics::Mean" (used in error messages).
  [[nodiscard]] const std::string& kind() const { return kind_; }

  /// Moves the state to `device`.
  void to(c10::Device device);

 protected:
  explicit Metric(std::string kind);

  /// Registers a state slot, initialised to the reduction's identity; returns its index.
  std::size_t add_state(std::string name, std::vector<int64_t> shape, Reduction reduction);
  /// The state tensor of slot `index` (update it in place, e.g. `state(i).add_(x)`).
  [[nodiscard]] at::Tensor& state(std::size_t index) { return state_[index]; }
  /// Moves the state to `input`'s device when it lives elsewhere (call first in every update).
  void follow_device(const at::Tensor& input);

  /// The values of a state given as one tensor per slot (any device).
  [[nodiscard]] virtual MetricValues values_from(const std::vector<at::Tensor>& state) const = 0;

 private:
  friend class MetricCollection;
  void attach_pending(std::shared_ptr<detail::PendingSync> pending, std::size_t first_slot);

  std::string kind_;
  std::vector<Slot> slots_;
  std::vector<at::Tensor> state_;
  std::vector<at::Tensor> synced_;
  std::shared_ptr<detail::PendingSync> pending_;  // own, or shared with a collection's sync
  std::size_t pending_first_ = 0;                 // this metric's first slot in pending_
};

}  // namespace d9d::metrics
