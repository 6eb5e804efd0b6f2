// d9d/core/detail/autocast_scope.hpp — bf16 autocast for one device type while alive, and the
// dtype it gives a matmul (not a public API; used by the train steps, recompute and the model's
// layers in .cpp files).
#pragma once

#include <optional>

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>

namespace d9d::detail {

/// The dtype autocast gives an at::linear (or another matmul) whose input is `x`: autocast's
/// dtype while autocast is on for x's device and x is floating point, else nothing.
[[nodiscard]] inline std::optional<at::ScalarType> autocast_dtype(const at::Tensor& x) {
  const auto device = x.device().type();
  if (x.is_floating_point() && at::autocast::is_autocast_enabled(device)) {
    return at::autocast::get_autocast_dtype(device);
  }
  return std::nullopt;
}

/// Enables bf16 autocast for `device` while alive when `enabled`; restores the previous state.
class AutocastScope {
 public:
  AutocastScope(bool enabled, c10::DeviceType device) : enabled_(enabled), device_(device) {
    if (enabled_) {
      previous_ = at::autocast::is_autocast_enabled(device_);
      previous_dtype_ = at::autocast::get_autocast_dtype(device_);
      at::autocast::set_autocast_dtype(device_, at::kBFloat16);
      at::autocast::set_autocast_enabled(device_, true);
      at::autocast::increment_nesting();
    }
  }
  ~AutocastScope() {
    if (enabled_) {
      if (at::autocast::decrement_nesting() == 0) {
        at::autocast::clear_cache();
      }
      at::autocast::set_autocast_enabled(device_, previous_);
      at::autocast::set_autocast_dtype(device_, previous_dtype_);
    }
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  AutocastScope(AutocastScope&&) = delete;
  AutocastScope& operator=(AutocastScope&&) = delete;

 private:
  bool enabled_;
  c10::DeviceType device_;
  bool previous_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace d9d::detail
