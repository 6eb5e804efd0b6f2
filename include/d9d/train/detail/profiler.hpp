// d9d/train/detail/profiler.hpp — the trainer's profiling pass (src/train/profiler.cpp): a Kineto
// trace around the configured steps ("profile" in the config) with a per-phase summary, and the
// device allocator's peak. Not a public API.
//
//   StepProfiler profiler(config.profile, context);
//   profiler.before(step); ...step...; std::string trace = profiler.after(step);
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include <d9d/core/distributed_context.hpp>
#include <d9d/train/config.hpp>

namespace d9d::detail {

/// The device allocator's peak statistics (CUDA and other caching allocators; CPU has none).
void reset_peak_memory(c10::Device device);
/// The most bytes the allocator had allocated since the last reset (0 on CPU).
int64_t peak_memory(c10::Device device);

/// The profiler around the configured steps (Kineto; CUDA kernels when the run is on a GPU). At
/// the end it writes rank-<r>.trace.json and rank-<r>.memory.json (peak, launches, kernels and
/// per d9d phase the memory rise, host time and launches) into the profile directory.
class StepProfiler {
 public:
  StepProfiler(const ProfileConfig& config, const DistributedContext& context);
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  StepProfiler(StepProfiler&&) = delete;
  StepProfiler& operator=(StepProfiler&&) = delete;
  ~StepProfiler();

  /// Starts the trace when `step` is the first profiled step.
  void before(int64_t step);
  /// Returns the trace's path on this rank when the profiled steps are over ("" otherwise).
  std::string after(int64_t step);

 private:
  ProfileConfig config_;
  const DistributedContext& context_;
  bool active_ = false;
};

}  // namespace d9d::detail
