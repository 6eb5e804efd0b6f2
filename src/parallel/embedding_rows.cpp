// d9d/parallel/embedding_rows.cpp — a deferred embedding lookup's rows, gathered over Replicate's
// group and added after the weight's all-reduce.
#include <algorithm>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/parallel/detail/embedding_rows.hpp>

namespace d9d::parallel::detail {

ReplicatedEmbeddingRows::ReplicatedEmbeddingRows(ProcessGroup group, at::Tensor weight)
    : group_(std::move(group)), weight_(std::move(weight)) {}

ReplicatedEmbeddingRows::~ReplicatedEmbeddingRows() = default;

void ReplicatedEmbeddingRows::begin() {
  const std::lock_guard<std::mutex> lock(mutex_);
  deferring_ = true;
}

bool ReplicatedEmbeddingRows::deferring() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return deferring_;
}

void ReplicatedEmbeddingRows::looked_up(const at::Tensor& ids) {
  // One deferred lookup per step on every rank, so every rank runs this exchange once. It is
  // issued in the forward and read in finish(). The count is made on the group's device: a copy
  // from the host would wait for the device to catch up.
  const auto device = group_.device();
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  DeferredLookup lookup;
  lookup.ids = ids.reshape({-1});
  // On a GPU, on a side stream, which waits for none of the caller's work: the exchange and the
  // copy of its result to the host run as soon as the peers issue theirs, and finish() waits for
  // that copy alone (on the caller's stream it would wait for the whole backward first).
  std::optional<c10::StreamGuard> side;
  if (!device.is_cpu()) {
    const c10::impl::VirtualGuardImpl streams(device.type());
    side.emplace(streams.getStreamFromGlobalPool(device));
  }
  lookup.mine = at::full({1}, ids.numel(), options);
  lookup.all = at::empty({group_.size()}, options);
  lookup.work = group_.backend()->_allgather_base(lookup.all, lookup.mine);
  if (side) {
    lookup.work->wait();
    lookup.host = lookup.all.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/true);
    lookup.arrived.emplace(device.type());
    lookup.arrived->record(side->current_stream());
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  deferring_ = false;
  ++lookups_;
  pending_ = std::move(lookup);
}

void ReplicatedEmbeddingRows::rows_backward(const at::Tensor& /*ids*/,
                                            const at::Tensor& rows_grad) {
  // The ids are the pending lookup's (kept since looked_up).
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_) {
    throw std::logic_error(
        "d9d::parallel::detail::ReplicatedEmbeddingRows: a lookup's backward ran after finish()");
  }
  auto& rows = pending_->rows;
  rows = rows.defined() ? rows + rows_grad : rows_grad;
}

at::Tensor ReplicatedEmbeddingRows::DeferredLookup::counts() const {
  if (arrived) {
    arrived->synchronize();  // the host copy of the exchange, made on the side stream
    return host;
  }
  work->wait();
  return all.cpu();
}

void ReplicatedEmbeddingRows::finish() {
  std::optional<DeferredLookup> lookup;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    deferring_ = false;
    if (!pending_) {
      return;
    }
    lookup.emplace(std::move(*pending_));
    pending_.reset();
  }
  const auto counts = lookup->counts();
  const auto* values = counts.const_data_ptr<int64_t>();
  const int64_t most = *std::max_element(values, values + counts.numel());
  const auto device = weight_.device();
  const int64_t hidden = weight_.size(1);
  // Every rank's part padded to the longest: id 0 with zero rows adds nothing.
  auto padded_ids = at::zeros({most}, at::TensorOptions().dtype(at::kLong).device(device));
  auto padded_rows = at::zeros({most, hidden}, weight_.options().requires_grad(false));
  const int64_t mine = lookup->ids.numel();
  if (mine > 0) {
    padded_ids.narrow(0, 0, mine).copy_(lookup->ids);
    if (lookup->rows.defined()) {
      padded_rows.narrow(0, 0, mine).copy_(lookup->rows);
    }
  }
  const auto all_ids = all_gather_cat(group_, padded_ids);
  const auto all_rows = all_gather_cat(group_, padded_rows);
  const at::NoGradGuard no_grad;
  auto& grad = weight_.mutable_grad();
  if (!grad.defined()) {
    grad = at::zeros_like(weight_);
  }
  grad.index_add_(0, all_ids.to(grad.device()), all_rows.to(grad.device(), grad.scalar_type()));
}

int64_t ReplicatedEmbeddingRows::deferred_lookups() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return lookups_;
}

}  // namespace d9d::parallel::detail
