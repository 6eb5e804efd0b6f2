// tests/advise/all_threads_meter.hpp — CPU bytes allocated and not yet freed since construction,
// counted on every thread (a test helper, not a public API). d9d::advise::CpuMemoryMeter counts
// through this thread's profiler hook, so a block that a collective's worker thread frees (Gloo
// drops its work's last reference to a buffer there) stays counted; under tensor parallelism the
// forward's collectives make that nondeterministic. This meter wraps LibTorch's CPU allocator
// instead: every block allocated while one is alive carries its own deleter that uncounts it,
// wherever it is freed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace d9d::testing {

class AllThreadsCpuMeter {
 public:
  AllThreadsCpuMeter() : state_(std::make_shared<State>()) { wrapper().watch(state_); }
  ~AllThreadsCpuMeter() { wrapper().watch(nullptr); }
  AllThreadsCpuMeter(const AllThreadsCpuMeter&) = delete;
  AllThreadsCpuMeter& operator=(const AllThreadsCpuMeter&) = delete;
  AllThreadsCpuMeter(AllThreadsCpuMeter&&) = delete;
  AllThreadsCpuMeter& operator=(AllThreadsCpuMeter&&) = delete;

  [[nodiscard]] int64_t live() const { return state_->live.load(); }

 private:
  struct State {
    std::atomic<int64_t> live{0};
  };
  struct Block {
    int64_t bytes = 0;
    std::shared_ptr<State> state;
    c10::DeleterFnPtr free = nullptr;  // the base allocator's
  };

  // Installed once per process (storages keep a pointer to their allocator, so it never goes
  // away); counts while a meter watches, else passes the allocation through untouched. Its blocks
  // keep data == context (what raw_allocate asserts); a table finds each one's count and deleter.
  class Wrapper final : public c10::Allocator {
   public:
    Wrapper() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, /*priority=*/100); }
    void watch(std::shared_ptr<State> state) {
      const std::lock_guard lock(mutex_);
      state_ = std::move(state);
    }

    c10::DataPtr allocate(std::size_t bytes) override {
      auto inner = base_->allocate(bytes);
      const std::lock_guard lock(mutex_);
      if (!state_ || inner.get() == nullptr || inner.get() != inner.get_context()) {
        return inner;
      }
      state_->live.fetch_add(static_cast<int64_t>(bytes));
      const auto device = inner.device();
      const auto free = inner.get_deleter();
      void* data = inner.release_context();
      blocks_[data] = Block{static_cast<int64_t>(bytes), state_, free};
      return {data, data, &release, device};
    }
    [[nodiscard]] c10::DeleterFnPtr raw_deleter() const override { return &release; }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
      default_copy_data(dest, src, count);
    }

   private:
    static void release(void* data) {
      auto& self = wrapper();
      c10::DeleterFnPtr free = nullptr;
      {
        const std::lock_guard lock(self.mutex_);
        const auto found = self.blocks_.find(data);
        if (found != self.blocks_.end()) {
          found->second.state->live.fetch_sub(found->second.bytes);
          free = found->second.free;
          self.blocks_.erase(found);
        }
      }
      (free != nullptr ? free : self.base_->raw_deleter())(data);
    }
    c10::Allocator* base_;
    std::mutex mutex_;
    std::shared_ptr<State> state_;
    std::unordered_map<void*, Block> blocks_;
  };

  static Wrapper& wrapper() {
    static auto* instance = new Wrapper();  // never destroyed (see Wrapper)
    return *instance;
  }

  std::shared_ptr<State> state_;
};

}  // namespace d9d::testing
