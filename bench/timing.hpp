// bench/timing.hpp — what the benchmarks time with: a steady-clock stopwatch, the device and dtype
// the kernel benchmarks run on, and Google Benchmark's manual timing of a batch of calls.
//
//   const d9d_bench::Stopwatch watch;  work();  std::printf("%.3f s\n", watch.seconds());
//   d9d_bench::run(state, bytes_per_call, /*calls=*/20, [&] { d9d::kernels::rms_norm(x, w); });
//   at::randn({rows, cols}, d9d_bench::options());   // bf16 on CUDA when available, else fp32
//
// Header-only and free of benchmark.h (run() takes any Google Benchmark-like state), so the
// benchmarks that do not link Google Benchmark use the stopwatch too.
#pragma once

#include <chrono>
#include <cstdint>

#include <ATen/ATen.h>
#include <torch/cuda.h>

namespace d9d_bench {

/// Seconds since construction, on the steady clock.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  [[nodiscard]] double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

/// Whether the kernel benchmarks run on CUDA (when a device is available).
inline bool on_cuda() { return torch::cuda::is_available(); }

/// The kernel benchmarks' tensors: bfloat16 on CUDA, float32 on the CPU.
inline at::TensorOptions options() {
  return on_cuda() ? at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16)
                   : at::TensorOptions().dtype(at::kFloat);
}

/// Waits for the device's queued work (nothing on the CPU).
inline void sync() {
  if (on_cuda()) {
    torch::cuda::synchronize();
  }
}

/// Times `calls` calls of `fn` per benchmark iteration (manual time, synchronised, reported per
/// call) after one warm-up call (allocator, kernel selection); reports `bytes_per_call` as bytes
/// processed and the device and dtype as the label.
template <class State, class Fn>
void run(State& state, double bytes_per_call, int calls, Fn&& fn) {
  fn();
  sync();
  for (auto _ : state) {
    const Stopwatch watch;
    for (int i = 0; i < calls; ++i) {
      fn();
    }
    sync();
    state.SetIterationTime(watch.seconds() / calls);
  }
  state.SetBytesProcessed(
      static_cast<int64_t>(bytes_per_call * static_cast<double>(state.iterations())));
  state.SetLabel(on_cuda() ? "cuda bf16" : "cpu fp32");
}

}  // namespace d9d_bench
