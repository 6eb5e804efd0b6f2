// d9d/metrics/metric.cpp — the Metric base: state slots, reset, merge, asynchronous sync.
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/metrics/metric.hpp>

#include "pending_sync.hpp"

namespace d9d::metrics {
namespace detail {
namespace {

c10d::ReduceOp to_c10d(Reduction reduction) {
  switch (reduction) {
    case Reduction::sum:
      return c10d::ReduceOp::SUM;
    case Reduction::min:
      return c10d::ReduceOp::MIN;
    case Reduction::max:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

PendingSync::PendingSync(const ProcessGroup& group, const std::vector<at::Tensor>& states,
                         const std::vector<Reduction>& reductions) {
  const bool communicate = group.valid() && group.size() > 1;
  for (const auto reduction : {Reduction::sum, Reduction::min, Reduction::max}) {
    Part part;
    part.reduction = reduction;
    for (std::size_t i = 0; i < states.size(); ++i) {
      if (reductions[i] == reduction) {
        part.slots.push_back(i);
      }
    }
    if (part.slots.empty()) {
      continue;
    }
    // The states may live on different devices (one updated on the GPU, another still on the
    // host: seen under NCCL with a task's metrics), so each goes to the buffer's device. at::cat
    // copies: the buffer is a snapshot, independent of later updates of the state.
    const auto target = communicate ? group.device() : states[part.slots.front()].device();
    std::vector<at::Tensor> flat;
    flat.reserve(part.slots.size());
    for (const auto i : part.slots) {
      flat.push_back(states[i].reshape({-1}).to(target, at::kDouble));
    }
    part.buffer = at::cat(flat);
    if (communicate) {
      std::vector<at::Tensor> tensors = {part.buffer};
      c10d::AllreduceOptions options;
      options.reduceOp = to_c10d(reduction);
      part.work = group.backend()->allreduce(tensors, options);
    }
    parts_.push_back(std::move(part));
  }
  shapes_.reserve(states.size());
  devices_.reserve(states.size());
  for (const auto& state : states) {
    shapes_.push_back(state.sizes().vec());
    devices_.push_back(state.device());
  }
}

PendingSync::~PendingSync() {
  for (auto& part : parts_) {
    if (part.work) {
      try {
        part.work->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }
  }
}

const std::vector<at::Tensor>& PendingSync::wait() {
  if (done_) {
    return results_;
  }
  results_.assign(shapes_.size(), at::Tensor());
  for (auto& part : parts_) {
    if (part.work) {
      part.work->wait();
      part.work.reset();
    }
    int64_t offset = 0;
    for (const auto slot : part.slots) {
      int64_t numel = 1;
      for (const auto size : shapes_[slot]) {
        numel *= size;
      }
      results_[slot] =
          part.buffer.narrow(0, offset, numel).reshape(shapes_[slot]).to(devices_[slot]).clone();
      offset += numel;
    }
  }
  parts_.clear();
  done_ = true;
  return results_;
}

}  // namespace detail

namespace {

double identity_of(Reduction reduction) {
  switch (reduction) {
    case Reduction::sum:
      return 0.0;
    case Reduction::min:
      return std::numeric_limits<double>::infinity();
    case Reduction::max:
      return -std::numeric_limits<double>::infinity();
  }
  return 0.0;
}

}  // namespace

Metric::Metric(std::string kind) : kind_(std::move(kind)) {}
Metric::~Metric() = default;
Metric::Metric(Metric&&) noexcept = default;
Metric& Metric::operator=(Metric&&) noexcept = default;

std::size_t Metric::add_state(std::string name, std::vector<int64_t> shape, Reduction reduction) {
  const auto device = state_.empty() ? c10::Device(c10::kCPU) : state_.front().device();
  state_.push_back(at::full(shape, identity_of(reduction),
                            at::TensorOptions().dtype(at::kDouble).device(device)));
  slots_.push_back({std::move(name), std::move(shape), reduction});
  return state_.size() - 1;
}

void Metric::follow_device(const at::Tensor& input) {
  if (!input.defined()) {
    throw std::invalid_argument(kind_ + ": undefined input tensor");
  }
  if (!state_.empty() && state_.front().device() != input.device()) {
    to(input.device());
  }
}

void Metric::to(c10::Device device) {
  for (auto& tensor : state_) {
    tensor = tensor.to(device);
  }
}

void Metric::reset() {
  for (std::size_t i = 0; i < state_.size(); ++i) {
    state_[i].fill_(identity_of(slots_[i].reduction));
  }
}

void Metric::merge(const Metric& other) {
  bool same = kind_ == other.kind_ && slots_.size() == other.slots_.size();
  for (std::size_t i = 0; same && i < slots_.size(); ++i) {
    same = slots_[i].shape == other.slots_[i].shape &&
           slots_[i].reduction == other.slots_[i].reduction;
  }
  if (!same) {
    throw std::invalid_argument(kind_ + "::merge: the other metric is a " + other.kind_ +
                                " with a different state (" + std::to_string(other.slots_.size()) +
                                " slots vs " + std::to_string(slots_.size()) +
                                "); merge metrics of one kind built with the same options");
  }
  for (std::size_t i = 0; i < state_.size(); ++i) {
    const auto theirs = other.state_[i].to(state_[i].device());
    switch (slots_[i].reduction) {
      case Reduction::sum:
        state_[i].add_(theirs);
        break;
      case Reduction::min:
        state_[i].copy_(at::minimum(state_[i], theirs));
        break;
      case Reduction::max:
        state_[i].copy_(at::maximum(state_[i], theirs));
        break;
    }
  }
}

void Metric::sync_start(const ProcessGroup& group) {
  if (pending_ && !pending_->done()) {
    throw std::logic_error(kind_ +
                           "::sync_start: a sync is pending; call sync_wait() (or "
                           "compute_synced()) before starting the next one");
  }
  std::vector<Reduction> reductions;
  reductions.reserve(slots_.size());
  for (const auto& slot : slots_) {
    reductions.push_back(slot.reduction);
  }
  attach_pending(std::make_shared<detail::PendingSync>(group, state_, reductions), 0);
}

void Metric::attach_pending(std::shared_ptr<detail::PendingSync> pending, std::size_t first_slot) {
  pending_ = std::move(pending);
  pending_first_ = first_slot;
  synced_.clear();
}

void Metric::sync_wait() {
  if (!pending_) {
    return;
  }
  const auto& results = pending_->wait();
  synced_.assign(results.begin() + static_cast<std::ptrdiff_t>(pending_first_),
                 results.begin() + static_cast<std::ptrdiff_t>(pending_first_ + slots_.size()));
  pending_.reset();
}

bool Metric::sync_pending() const { return pending_ != nullptr && !pending_->done(); }

bool Metric::has_synced() const { return pending_ != nullptr || !synced_.empty(); }

const std::vector<at::Tensor>& Metric::synced_state() {
  sync_wait();
  if (synced_.empty() && !slots_.empty()) {
    throw std::logic_error(kind_ +
                           ": no synced state; call sync_start(group) (and sync_wait()) first, "
                           "or read the local value with compute() / values()");
  }
  return synced_;
}

MetricValues Metric::values() const { return values_from(state_); }

MetricValues Metric::synced_values() { return values_from(synced_state()); }

}  // namespace d9d::metrics
