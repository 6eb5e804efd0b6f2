// src/metrics/pending_sync.hpp — the in-flight all-reduces of one sync (private to d9d::metrics).
#pragma once

#include <cstddef>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <d9d/core/process_group.hpp>
#include <d9d/metrics/metric.hpp>

namespace d9d::metrics::detail {

/// Copies of state tensors packed into one flat float64 buffer per reduction, all-reduced
/// asynchronously; wait() unpacks the global tensors (in the order given, on each input's device).
struct PendingSync {
  /// Packs `states` (one tensor per slot, with its reduction) and launches the all-reduces.
  PendingSync(const ProcessGroup& group, const std::vector<at::Tensor>& states,
              const std::vector<Reduction>& reductions);
  /// Waits for work never waited for (the buffers must outlive the backend's use of them).
  ~PendingSync();
  PendingSync(const PendingSync&) = delete;
  PendingSync& operator=(const PendingSync&) = delete;
  PendingSync(PendingSync&&) = delete;
  PendingSync& operator=(PendingSync&&) = delete;

  /// Idempotent: completes the all-reduces and returns the global tensors, one per input slot.
  const std::vector<at::Tensor>& wait();
  [[nodiscard]] bool done() const { return done_; }

 private:
  struct Part {
    Reduction reduction = Reduction::sum;
    std::vector<std::size_t> slots;  // indices into the inputs, in packing order
    at::Tensor buffer;               // flat, on the group's device
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<Part> parts_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<c10::Device> devices_;
  std::vector<at::Tensor> results_;
  bool done_ = false;
};

}  // namespace d9d::metrics::detail
