// d9d/core/weight_grad.hpp — split backward: input gradients now, weight gradients later.
//
//   d9d::WeightGradQueue queue;
//   at::Tensor out;
//   {
//     d9d::RecordWeightGrads record(queue);  // forward: layers bind to `queue`
//     out = stage(x);
//   }
//   {
//     d9d::DeferWeightGrads defer(queue);    // backward: only input gradients (I)
//     torch::autograd::backward({out}, {grad_out});
//   }
//   queue.drain();                           // the weight-gradient GEMMs (W)
//
// Zero-bubble pipeline schedules split a stage's backward into I (the gradient of the stage's
// input, which the previous stage waits for) and W (the gradients of the weights, which nobody
// waits for and which fill the pipeline's bubbles). The library's linear layers
// (d9d::model::Linear) run through a split-capable autograd function when a queue records their
// forward; while the queue defers, their backward returns the input gradient and queues the
// weight-gradient GEMM; drain() runs the queued work and accumulates into the parameters' .grad.
// Other parameters (norms, embeddings) get their gradients in I as usual. A backward that does not
// defer computes everything at once. Without a recording queue the layers call at::linear: no cost
// when unused.
//
// Gradients accumulated by drain() do not fire the parameters' post-accumulate-grad hooks.
//
// The queue sits in core, below both its users: the model's split-capable layers
// (src/model/split_linear.cpp) push into it, the pipeline executor records, defers and drains it.
// It needs nothing but the standard library.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace d9d {

/// Weight-gradient work queued by split backward passes, for one (stage, microbatch).
class WeightGradQueue {
 public:
  WeightGradQueue() = default;
  WeightGradQueue(const WeightGradQueue&) = delete;
  WeightGradQueue& operator=(const WeightGradQueue&) = delete;
  WeightGradQueue(WeightGradQueue&&) = delete;
  WeightGradQueue& operator=(WeightGradQueue&&) = delete;
  ~WeightGradQueue() = default;

  /// Whether backward passes of layers bound to this queue queue their weight gradients.
  [[nodiscard]] bool deferring() const { return deferring_; }
  void set_deferring(bool on) { deferring_ = on; }

  /// Queues work (called from the autograd engine's thread while deferring).
  void push(std::function<void()> job) { jobs_.push_back(std::move(job)); }
  /// Runs the queued work in order and empties the queue.
  void drain();
  /// Drops the queued work without running it (e.g. after a failed step).
  void clear() { jobs_.clear(); }
  [[nodiscard]] std::size_t size() const { return jobs_.size(); }
  [[nodiscard]] bool empty() const { return jobs_.empty(); }

 private:
  std::vector<std::function<void()>> jobs_;
  bool deferring_ = false;
};

/// While alive, forward passes on this thread bind split-capable layers to `queue` (restores the
/// previous binding when destroyed, so scopes nest).
class RecordWeightGrads {
 public:
  explicit RecordWeightGrads(WeightGradQueue& queue);
  RecordWeightGrads(const RecordWeightGrads&) = delete;
  RecordWeightGrads& operator=(const RecordWeightGrads&) = delete;
  RecordWeightGrads(RecordWeightGrads&&) = delete;
  RecordWeightGrads& operator=(RecordWeightGrads&&) = delete;
  ~RecordWeightGrads();

 private:
  WeightGradQueue* previous_;
};

/// While alive, backward passes through layers bound to `queue` queue their weight gradients.
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradQueue& queue) : queue_(queue) { queue_.set_deferring(true); }
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;
  DeferWeightGrads(DeferWeightGrads&&) = delete;
  DeferWeightGrads& operator=(DeferWeightGrads&&) = delete;
  ~DeferWeightGrads() { queue_.set_deferring(false); }

 private:
  WeightGradQueue& queue_;
};

/// The queue that forward passes on this thread record into, or nullptr.
[[nodiscard]] WeightGradQueue* recording_weight_grads();

}  // namespace d9d
