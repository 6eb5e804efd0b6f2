// bench/rms_norm_bench.cpp — d9d::rms_norm against ATen's eager composition (what a model written
// with plain tensor ops runs), forward and forward+backward, reported as achieved GB/s.
//
//   rms_norm_bench                                  # CUDA (bf16) when available, else CPU (fp32)
//   rms_norm_bench --benchmark_filter=Forward
//
// Bytes counted are the minimum each pass must move: forward reads x and writes y (+ weight, rstd);
// forward+backward additionally reads dy and x and writes dx. Higher is better; on GPU compare
// with the card's memory bandwidth (H100 SXM ~3.35 TB/s, H200 ~4.8 TB/s).

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/kernels/rms_norm.hpp>

#include "timing.hpp"

namespace {

constexpr double kEps = 1e-6;
constexpr int kLaunchesPerIteration = 20;

using d9d_bench::on_cuda;
using d9d_bench::options;

at::Tensor eager_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  const auto xf = x.to(at::kFloat);
  const auto rstd = (xf.pow(2).mean({-1}, /*keepdim=*/true) + kEps).rsqrt();
  return (xf * rstd * w.to(at::kFloat)).to(x.scalar_type());
}

// Times `kLaunchesPerIteration` calls of `fn` per benchmark iteration (manual time, synchronised).
template <typename Fn>
void run(benchmark::State& state, double bytes_per_call, Fn&& fn) {
  d9d_bench::run(state, bytes_per_call, kLaunchesPerIteration, fn);
}

struct Inputs {
  at::Tensor x, w, dy;
  double elem = 0;
  double rows = 0;
  double cols = 0;
};

Inputs make_inputs(const benchmark::State& state) {
  Inputs in;
  const int64_t rows = state.range(0);
  const int64_t cols = state.range(1);
  in.x = at::randn({rows, cols}, options());
  in.w = at::rand({cols}, options()) + 0.5;
  in.dy = at::randn({rows, cols}, options());
  in.elem = static_cast<double>(in.x.element_size());
  in.rows = static_cast<double>(rows);
  in.cols = static_cast<double>(cols);
  return in;
}

double forward_bytes(const Inputs& in) {
  return 2 * in.rows * in.cols * in.elem + in.cols * in.elem + in.rows * 4;
}

double forward_backward_bytes(const Inputs& in) {
  return forward_bytes(in) + 3 * in.rows * in.cols * in.elem + 2 * in.cols * in.elem;
}

void BM_Forward_D9d(benchmark::State& state) {
  const auto in = make_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, forward_bytes(in),
      [&] { benchmark::DoNotOptimize(d9d::kernels::rms_norm(in.x, in.w, kEps)); });
}

void BM_Forward_AtenEager(benchmark::State& state) {
  const auto in = make_inputs(state);
  const at::NoGradGuard no_grad;
  run(state, forward_bytes(in), [&] { benchmark::DoNotOptimize(eager_rms_norm(in.x, in.w)); });
}

template <typename Norm>
void forward_backward(benchmark::State& state, Norm&& norm) {
  const auto in = make_inputs(state);
  const auto x = in.x.detach().requires_grad_(true);
  const auto w = in.w.detach().requires_grad_(true);
  run(state, forward_backward_bytes(in), [&] {
    const auto y = norm(x, w);
    benchmark::DoNotOptimize(torch::autograd::grad({y}, {x, w}, {in.dy}));
  });
}

void BM_ForwardBackward_D9d(benchmark::State& state) {
  forward_backward(state, [](const at::Tensor& x, const at::Tensor& w) {
    return d9d::kernels::rms_norm(x, w, kEps);
  });
}

void BM_ForwardBackward_AtenEager(benchmark::State& state) {
  forward_backward(state,
                   [](const at::Tensor& x, const at::Tensor& w) { return eager_rms_norm(x, w); });
}

// {rows, hidden}: a 16k-token batch at Qwen3-0.6B / 8B widths, and per-head QK-norm rows.
void shapes(benchmark::internal::Benchmark* b) {
  if (on_cuda()) {
    b->Args({16384, 1024})->Args({16384, 4096})->Args({65536, 4096})->Args({262144, 128});
  } else {
    b->Args({1024, 1024})->Args({4096, 128});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Forward_D9d)->Apply(shapes);
BENCHMARK(BM_Forward_AtenEager)->Apply(shapes);
BENCHMARK(BM_ForwardBackward_D9d)->Apply(shapes);
BENCHMARK(BM_ForwardBackward_AtenEager)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
