// d9d/core/detail/autocast_scope.hpp — bf16 autocast for one device type while alive (not a
// public API; used by the train steps and recompute in .cpp files).
#pragma once

#include <ATen/autocast_mode.h>

namespace d9d::detail {

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
