// d9d::advise::CpuMemoryMeter (d9d/advise/memory_meter.hpp).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <d9d/advise/memory_meter.hpp>

namespace d9d::advise {

namespace {

class Reporter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    if (!device.is_cpu()) {
      return;
    }
    const int64_t now = live_.fetch_add(alloc_size) + alloc_size;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  [[nodiscard]] bool memoryProfilingEnabled() const override { return true; }

  [[nodiscard]] int64_t live() const { return live_.load(); }
  [[nodiscard]] int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace

struct CpuMemoryMeter::Impl {
  std::shared_ptr<Reporter> reporter = std::make_shared<Reporter>();
  c10::DebugInfoGuard guard{c10::DebugInfoKind::PROFILER_STATE, reporter};
};

CpuMemoryMeter::CpuMemoryMeter() : impl_(std::make_unique<Impl>()) {}
CpuMemoryMeter::~CpuMemoryMeter() = default;

int64_t CpuMemoryMeter::live() const { return impl_->reporter->live(); }
int64_t CpuMemoryMeter::peak() const { return impl_->reporter->peak(); }
void CpuMemoryMeter::reset_peak() { impl_->reporter->reset_peak(); }

}  // namespace d9d::advise
