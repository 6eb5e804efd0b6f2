// d9d/advise/memory_meter.hpp — the host memory a piece of work allocates, measured: the CPU bytes
// allocated and freed through LibTorch's CPU allocator on this thread while a CpuMemoryMeter lives
// (what the advisor's activation prediction is checked against on the CPU).
//
//   d9d::advise::CpuMemoryMeter meter;
//   auto loss = model->loss(ids, labels).loss_sum;   // live(): what the forward keeps
//   const int64_t saved = meter.live();
//   loss.backward();
//   meter.peak();                                     // the most live at once since construction
//
// It installs a c10 memory reporter (the one the profiler uses) in this thread's debug info, so
// work on threads that inherit it (the autograd engine's) is counted too. Only blocks allocated
// while a meter is installed are counted, and their frees only when they happen under a meter;
// a block allocated under it and freed elsewhere stays counted. Device memory is not counted (the
// device allocators have their own statistics).
#pragma once

#include <cstdint>
#include <memory>

namespace d9d::advise {

class CpuMemoryMeter {
 public:
  CpuMemoryMeter();
  ~CpuMemoryMeter();
  CpuMemoryMeter(const CpuMemoryMeter&) = delete;
  CpuMemoryMeter& operator=(const CpuMemoryMeter&) = delete;
  CpuMemoryMeter(CpuMemoryMeter&&) = delete;
  CpuMemoryMeter& operator=(CpuMemoryMeter&&) = delete;

  /// Bytes allocated and not yet freed since construction.
  [[nodiscard]] int64_t live() const;
  /// The most live() was at any moment since construction or reset_peak().
  [[nodiscard]] int64_t peak() const;
  /// Starts the peak again from live().
  void reset_peak();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace d9d::advise
