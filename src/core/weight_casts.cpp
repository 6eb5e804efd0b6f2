// d9d/core/weight_casts.cpp — the step-long cache of weights cast to the compute dtype
// (d9d/core/detail/weight_casts.hpp).
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <d9d/core/detail/weight_casts.hpp>

namespace d9d::detail {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> source;
  const void* data = nullptr;
  int64_t version = 0;
  at::Tensor cast;

  [[nodiscard]] bool holds(const at::Tensor& weight, at::ScalarType dtype) const {
    return !source.expired() && weight.const_data_ptr() == data && weight._version() == version &&
           cast.scalar_type() == dtype && cast.sizes() == weight.sizes();
  }
};

struct Cache {
  std::mutex mutex;
  int scopes = 0;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
};

Cache& cache() {
  static Cache instance;
  return instance;
}

// A tensor whose cast may be kept: a leaf (parameters are; activations computed with gradients
// are not), with a version counter (inference tensors have none) and memory.
bool cacheable(const at::Tensor& weight) {
  return weight.is_leaf() && !weight.is_inference() && weight.has_storage() &&
         weight.const_data_ptr() != nullptr;
}

}  // namespace

WeightCastScope::WeightCastScope(bool enabled) : enabled_(enabled) {
  if (enabled_) {
    auto& c = cache();
    const std::lock_guard lock(c.mutex);
    ++c.scopes;
  }
}

WeightCastScope::~WeightCastScope() {
  if (!enabled_) {
    return;
  }
  std::unordered_map<const c10::TensorImpl*, Entry> freed;
  {
    auto& c = cache();
    const std::lock_guard lock(c.mutex);
    if (--c.scopes == 0) {
      freed = std::move(c.entries);
      c.entries.clear();
    }
  }
  // `freed` releases the copies here, outside the lock.
}

at::Tensor cast_weight(const at::Tensor& weight, at::ScalarType dtype) {
  if (!weight.defined() || weight.scalar_type() == dtype) {
    return weight;
  }
  auto& c = cache();
  const bool keep = cacheable(weight);
  if (keep) {
    const std::lock_guard lock(c.mutex);
    const auto found = c.entries.find(weight.unsafeGetTensorImpl());
    if (found != c.entries.end() && found->second.holds(weight, dtype)) {
      return found->second.cast;
    }
  }
  at::Tensor cast;
  {
    const at::NoGradGuard no_grad;  // a copy of the values, without the weight's history
    cast = weight.to(dtype);
  }
  if (keep) {
    const std::lock_guard lock(c.mutex);
    if (c.scopes > 0) {
      c.entries.insert_or_assign(
          weight.unsafeGetTensorImpl(),
          Entry{.source = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                    weight.getIntrusivePtr()),
                .data = weight.const_data_ptr(),
                .version = weight._version(),
                .cast = cast});
    }
  }
  return cast;
}

std::size_t cached_weight_casts() {
  auto& c = cache();
  const std::lock_guard lock(c.mutex);
  return c.entries.size();
}

}  // namespace d9d::detail
