// d9d/parallel/replicate.cpp — bucketed, overlapped gradient all-reduce for replicated parameters.
#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/core/detail/gradient_home.hpp>
#include <d9d/parallel/detail/copy_engine_reduce.hpp>
#include <d9d/parallel/replicate.hpp>

namespace d9d::parallel {

struct GradientReducer::State {
  struct Bucket {
    std::vector<std::size_t> members;  // parameter indices
    int64_t numel = 0;
    std::size_t pending = 0;
    bool launched = false;
    at::Tensor buffer;                // the flattened bucket, when it was flattened
    std::vector<at::Tensor> tensors;  // what the all-reduce reduces in place
    c10::intrusive_ptr<c10d::Work> work;
    int64_t offset = 0;                 // ReduceEngine::copy: bytes into the copy buffer
    at::ScalarType dtype = at::kFloat;  // ReduceEngine::copy: what the bucket is summed in
  };

  ProcessGroup group;
  std::optional<at::ScalarType> reduce_dtype;
  std::unique_ptr<detail::CopyEngineReduce> copy;  // ReduceEngine::copy
  std::vector<at::Tensor> parameters;
  std::vector<std::size_t> bucket_of;  // parameter index -> bucket index
  std::vector<Bucket> buckets;
  std::mutex mutex;
  bool armed = false;
  std::size_t next_launch = 0;
  std::size_t launched_in_backward = 0;
  // ReduceEngine::copy: each parameter's byte offset into the copy buffer (its place, in its
  // bucket's dtype), and whether home() handed that place out since the last finish().
  std::vector<int64_t> place_offset;
  std::vector<bool> homed;

  // ReduceEngine::copy: each bucket's range of the copy buffer (aligned for any dtype's view) and
  // each parameter's place in it, in the reduction's dtype (else the bucket's parameters'); the
  // buffer mapped on every rank (collective).
  void lay_out_copy(std::optional<at::ScalarType> dtype) {
    int64_t total = 0;
    int64_t largest = 0;
    place_offset.assign(parameters.size(), -1);
    homed.assign(parameters.size(), false);
    for (auto& bucket : buckets) {
      bucket.dtype = dtype.value_or(parameters[bucket.members.front()].scalar_type());
      bucket.offset = total;
      const auto element = static_cast<int64_t>(c10::elementSize(bucket.dtype));
      int64_t offset = bucket.offset;
      for (const auto index : bucket.members) {
        place_offset[index] = offset;
        offset += parameters[index].numel() * element;
      }
      const int64_t size = bucket.numel * element;
      largest = std::max(largest, size);
      total += (size + 255) / 256 * 256;
    }
    copy = std::make_unique<detail::CopyEngineReduce>(group, total, largest);
  }

  // ReduceEngine::copy: whether the parameter's gradient can be its place (the bucket's dtype is
  // the parameter's, on the buffer's device), and a new tensor over that place, its sizes.
  [[nodiscard]] bool lives_in_buffer(std::size_t index) const {
    const auto& param = parameters[index];
    return param.scalar_type() == buckets[bucket_of[index]].dtype &&
           param.device() == copy->buffer().device();
  }
  [[nodiscard]] at::Tensor place_of(std::size_t index) const {
    const auto& param = parameters[index];
    const auto flat = copy->buffer();
    return at::empty({0}, flat.options().dtype(param.scalar_type()))
        .set_(flat.storage(), place_offset[index] / static_cast<int64_t>(param.element_size()),
              param.sizes());
  }

  // ReduceEngine::copy: a new tensor over the parameter's place in the copy buffer, once per step.
  at::Tensor home(std::size_t index) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!copy || index >= place_offset.size() || !lives_in_buffer(index) || homed[index]) {
      return {};
    }
    homed[index] = true;
    return place_of(index);
  }

  // Starts the bucket's all-reduce. Gradients that are dense, contiguous and on the group's device
  // are reduced where they are, one coalesced all-reduce for the bucket (no flattening into a
  // buffer, nothing to copy back), or, in another reduction dtype, each cast to it (copied back in
  // finish()). Otherwise (a gradient missing or laid out otherwise) the bucket is flattened into
  // one buffer, zeros for a missing gradient.
  void launch(Bucket& bucket) {
    if (copy) {
      launch_copy(bucket);
      return;
    }
    const auto& first = parameters[bucket.members.front()].grad();
    const auto dtype = reduce_dtype.value_or(
        first.defined() ? first.scalar_type() : parameters[bucket.members.front()].scalar_type());
    bool direct = true;
    for (const auto index : bucket.members) {
      const auto& grad = parameters[index].grad();
      direct = direct && grad.defined() && grad.is_contiguous() && !grad.is_sparse() &&
               grad.device() == group.device() && grad.scalar_type() == first.scalar_type();
    }
    bucket.tensors.clear();
    bucket.buffer = at::Tensor();
    if (direct) {
      for (const auto index : bucket.members) {
        const auto& grad = parameters[index].grad();
        bucket.tensors.push_back(grad.scalar_type() == dtype ? grad : grad.to(dtype));
      }
    } else {
      std::vector<at::Tensor> flat;
      flat.reserve(bucket.members.size());
      for (const auto index : bucket.members) {
        const auto& param = parameters[index];
        const auto& grad = param.grad();
        flat.push_back(grad.defined() ? grad.reshape({-1})
                                      : at::zeros({param.numel()}, param.options()));
      }
      bucket.buffer = at::cat(flat).to(group.device(), dtype);
      bucket.tensors.push_back(bucket.buffer);
    }
    bucket.work = bucket.tensors.size() == 1 ? group.backend()->allreduce(bucket.tensors)
                                             : group.backend()->allreduce_coalesced(bucket.tensors);
    bucket.launched = true;
  }

  // ReduceEngine::copy: on the side stream, after the backward's work so far, the gradients are
  // copied into the bucket's range of the copy buffer, in one launch (nothing to copy where a
  // gradient is its place already: written there by the layers, design note 0031, and accumulated
  // in place) and summed there. The gradients stay referenced until finish(), when the caller's
  // stream has waited for the side stream.
  void launch_copy(Bucket& bucket) {
    copy->on_side([&] {
      const auto flat = copy->buffer();
      bucket.tensors.clear();
      std::vector<at::Tensor> places;
      std::vector<at::Tensor> sources;
      for (const auto index : bucket.members) {
        const auto& param = parameters[index];
        const auto& grad = param.grad();
        const int64_t bytes = param.numel() * static_cast<int64_t>(c10::elementSize(bucket.dtype));
        auto place = flat.narrow(0, place_offset[index], bytes).view(bucket.dtype);
        if (!grad.defined()) {
          place.zero_();
        } else if (!(grad.scalar_type() == bucket.dtype && grad.is_contiguous() &&
                     grad.data_ptr() == place.data_ptr())) {
          places.push_back(place.view(grad.sizes()));
          sources.push_back(grad);  // another dtype: converted by the copy
        }
        bucket.tensors.push_back(grad);
      }
      if (!places.empty()) {
        at::_foreach_copy_(places, sources);
      }
      copy->sum(bucket.offset, bucket.numel, bucket.dtype);
    });
    bucket.launched = true;
  }

  // ReduceEngine::copy, after every bucket was launched: the caller's stream waits for the sums,
  // then each gradient becomes its range of the copy buffer (a tensor of its own over the
  // buffer's storage), or, in another dtype, gets the sums copied in.
  void finish_copy() {
    copy->on_side([&] { copy->end_of_step(); });
    copy->join();
    const auto flat = copy->buffer();
    for (auto& bucket : buckets) {
      for (const auto index : bucket.members) {
        auto& param = parameters[index];
        if (lives_in_buffer(index)) {
          param.mutable_grad() = place_of(index);
        } else {
          const int64_t size = static_cast<int64_t>(c10::elementSize(bucket.dtype));
          auto summed = flat.narrow(0, place_offset[index], param.numel() * size)
                            .view(bucket.dtype)
                            .view(param.sizes());
          if (param.grad().defined()) {
            param.mutable_grad().copy_(summed);
          } else {
            param.mutable_grad() = summed.to(param.device(), param.scalar_type(),
                                             /*non_blocking=*/false, /*copy=*/true);
          }
        }
      }
      bucket.tensors.clear();
    }
    std::fill(homed.begin(), homed.end(), false);
  }

  // A flattened bucket's sums back into the gradients.
  void write_back(Bucket& bucket) {
    int64_t offset = 0;
    for (const auto index : bucket.members) {
      auto& param = parameters[index];
      const int64_t numel = param.numel();
      auto summed = bucket.buffer.narrow(0, offset, numel).view(param.sizes());
      if (summed.scalar_type() == param.scalar_type() && summed.device() == param.device()) {
        // The bucket's memory becomes the gradient, with no copy back (the old gradient is
        // freed): a tensor of its own over the bucket's storage, not a view (optimizers detach
        // gradients in place, which views refuse). A later backward adds into it in place.
        param.mutable_grad() =
            at::empty({0}, bucket.buffer.options())
                .set_(bucket.buffer.storage(), bucket.buffer.storage_offset() + offset,
                      param.sizes(), param.strides());
      } else if (param.grad().defined()) {
        param.mutable_grad().copy_(summed);
      } else {
        param.mutable_grad() = summed.to(param.device(), param.scalar_type(),
                                         /*non_blocking=*/false, /*copy=*/true);
      }
      offset += numel;
    }
  }

  // Launches ready buckets in bucket order (the same order on every rank).
  void launch_ready(bool from_hook) {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0 &&
           !buckets[next_launch].launched) {
      launch(buckets[next_launch]);
      if (from_hook) {
        ++launched_in_backward;
      }
      ++next_launch;
    }
  }

  void mark_ready(std::size_t index) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!armed) {
      return;
    }
    auto& bucket = buckets[bucket_of[index]];
    if (bucket.pending > 0) {
      --bucket.pending;
    }
    launch_ready(/*from_hook=*/true);
  }
};

ReduceEngine automatic_reduce_engine(const ProcessGroup& group, int world_size,
                                     int local_world_size, bool pipelined) {
  const bool copy = detail::CopyEngineReduce::built() && group.device().is_cuda() &&
                    group.size() > 1 && group.size() == world_size &&
                    local_world_size == world_size && !pipelined;
  return copy ? ReduceEngine::copy : ReduceEngine::backend;
}

namespace {

// The reducer's hook: a parameter's gradient is complete for this backward; and, under the copy
// engine, where the step's gradient may live (d9d/core/detail/gradient_home.hpp).
class ReadyHook : public d9d::detail::GradientHome {
 public:
  ReadyHook(std::weak_ptr<GradientReducer::State> state, std::size_t index)
      : state_(std::move(state)), index_(index) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override {
    if (auto state = state_.lock()) {
      state->mark_ready(index_);
    }
  }
  [[nodiscard]] at::Tensor home() override {
    auto state = state_.lock();
    return state ? state->home(index_) : at::Tensor();
  }

 private:
  std::weak_ptr<GradientReducer::State> state_;
  std::size_t index_;
};

}  // namespace

GradientReducer::GradientReducer(ProcessGroup group, std::vector<at::Tensor> parameters,
                                 const GradientReducerOptions& options)
    : state_(std::make_shared<State>()) {
  if (options.bucket_bytes < 1) {
    throw std::invalid_argument("d9d::parallel::GradientReducer: bucket_bytes must be >= 1");
  }
  state_->group = std::move(group);
  state_->reduce_dtype = options.reduce_dtype;
  state_->parameters = std::move(parameters);
  auto& s = *state_;
  if (s.group.size() <= 1) {
    return;
  }
  s.bucket_of.resize(s.parameters.size());
  // The parameters complete first, each in a bucket of its own.
  std::vector<bool> placed(s.parameters.size(), false);
  for (const auto& early : options.first) {
    for (std::size_t k = 0; k < s.parameters.size(); ++k) {
      const auto& param = s.parameters[k];
      if (!placed[k] && param.requires_grad() && param.is_same(early)) {
        s.buckets.emplace_back();
        s.buckets.back().members.push_back(k);
        s.buckets.back().numel = param.numel();
        s.bucket_of[k] = s.buckets.size() - 1;
        placed[k] = true;
      }
    }
  }
  const std::size_t early_buckets = s.buckets.size();
  // Reverse registration order: the last layers' gradients arrive first in backward.
  int64_t bytes = 0;
  for (std::size_t k = s.parameters.size(); k-- > 0;) {
    const auto& param = s.parameters[k];
    if (!param.requires_grad() || placed[k]) {
      continue;
    }
    const int64_t size = param.numel() * static_cast<int64_t>(param.element_size());
    const bool fresh = s.buckets.size() == early_buckets;
    const bool full = !fresh && bytes + size > options.bucket_bytes;
    const bool other_dtype =
        !fresh &&
        param.scalar_type() != s.parameters[s.buckets.back().members.front()].scalar_type();
    if (fresh || full || other_dtype) {
      s.buckets.emplace_back();
      bytes = 0;
    }
    s.buckets.back().members.push_back(k);
    s.buckets.back().numel += param.numel();
    s.bucket_of[k] = s.buckets.size() - 1;
    bytes += size;
  }
  if (options.engine == ReduceEngine::copy && !s.buckets.empty()) {
    s.lay_out_copy(options.reduce_dtype);
  }
  for (const auto& bucket : s.buckets) {
    for (const auto index : bucket.members) {
      torch::autograd::impl::set_post_acc_grad_hooks(s.parameters[index],
                                                     std::make_unique<ReadyHook>(state_, index));
    }
  }
}

GradientReducer::~GradientReducer() {
  if (!state_ || state_->group.size() <= 1) {
    return;
  }
  for (const auto& bucket : state_->buckets) {
    for (const auto index : bucket.members) {
      torch::autograd::impl::set_post_acc_grad_hooks(state_->parameters[index], nullptr);
    }
  }
}

void GradientReducer::arm() {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  state_->armed = true;
  state_->next_launch = 0;
  state_->launched_in_backward = 0;
  for (auto& bucket : state_->buckets) {
    bucket.pending = bucket.members.size();
    bucket.launched = false;
    bucket.work.reset();
    bucket.buffer = at::Tensor();
    bucket.tensors.clear();
  }
}

void GradientReducer::launch_all() {
  auto& s = *state_;
  const std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.armed || s.group.size() <= 1) {
    return;
  }
  for (auto& bucket : s.buckets) {
    bucket.pending = 0;
  }
  s.launch_ready(/*from_hook=*/false);
}

void GradientReducer::finish() {
  auto& s = *state_;
  const std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.armed) {
    return;
  }
  s.armed = false;
  if (s.group.size() <= 1) {
    return;
  }
  // Buckets still waiting (parameters without a gradient this step) go now, in order.
  for (auto& bucket : s.buckets) {
    bucket.pending = 0;
  }
  s.launch_ready(/*from_hook=*/false);
  if (s.copy) {
    s.finish_copy();
    return;
  }
  for (auto& bucket : s.buckets) {
    bucket.work->wait();
    if (bucket.buffer.defined()) {
      s.write_back(bucket);
    } else {
      for (std::size_t k = 0; k < bucket.members.size(); ++k) {
        auto& grad = s.parameters[bucket.members[k]].mutable_grad();
        if (!bucket.tensors[k].is_same(grad)) {
          grad.copy_(bucket.tensors[k]);  // reduced in another dtype
        }
      }
    }
    bucket.buffer = at::Tensor();
    bucket.tensors.clear();
    bucket.work.reset();
  }
}

std::size_t GradientReducer::bucket_count() const { return state_->buckets.size(); }
std::size_t GradientReducer::launched_during_backward() const {
  return state_->launched_in_backward;
}

}  // namespace d9d::parallel
