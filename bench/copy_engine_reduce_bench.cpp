// bench/copy_engine_reduce_bench.cpp — does a gradient all-reduce slow the backward beside it less
// when the copy engines move its bytes (symmetric memory, design note 0028) than when NCCL's
// kernels do?
//
//   tools/d9drun -n 2 build/copy_engine_reduce_bench            # CUDA build, one GPU per rank
//   ... --layers 28 --gemms 6 --tokens 16384 --hidden 1024 --ffn 3072 --grad-gb 2.4 --bucket-mb 25
//
// The workload stands for a backward: per layer, bf16 GEMMs of the MLP's shapes and elementwise
// passes on the compute stream; after each layer its share of the float32 gradients (grad-gb in
// all, in buckets of bucket-mb) is ready and reduced beside the next layers:
//   nccl      ProcessGroupNCCL::allreduce per bucket, launched from the compute stream (what
//             d9d's GradientReducer does);
//   ce        d9d::parallel::detail::CopyEngineReduce (what ReduceEngine::copy runs) on its side
//             stream: a barrier, each rank pulls its chunk of the bucket from every peer with
//             cudaMemcpyAsync (copy engines over NVLink), sums it, a barrier, pulls the other
//             chunks' sums from their owners; the gradients live in its shared buffer;
//   ce-staged the same, with the gradients copied into the buffer and back per bucket.
// Each mode runs with the workload ("+ work") and alone, and the workload runs without a reduction
// ("none"); the table gives the workload's time (compute-stream events) and the step's (both
// streams done), medians over the iterations.
// The ce modes' sums are checked against NCCL's before timing.
// CMake builds it only in CUDA builds, where the library defines D9D_WITH_CUDA; without it (the
// lint's parse) the program only says so.

#ifdef D9D_WITH_CUDA
#include <algorithm>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <CLI/CLI.hpp>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/core/distributed_context.hpp>
#include <d9d/parallel/detail/copy_engine_reduce.hpp>

namespace {

struct Options {
  int layers = 28;
  int gemms = 6;  // per layer, each [tokens, hidden] x [hidden, ffn]
  int64_t tokens = 16384;
  int64_t hidden = 1024;
  int64_t ffn = 3072;
  int elementwise = 4;  // per layer, each a pass over [tokens, ffn] bf16
  double grad_gb = 2.4;
  double bucket_mb = 25;
  int warmup = 3;
  int iterations = 10;
};

// A bucket: [offset, offset + numel) of the flat float32 gradients.
struct Bucket {
  int64_t offset = 0;
  int64_t numel = 0;
};

enum class Mode { none, nccl, ce, ce_staged };

const char* name_of(Mode mode) {
  switch (mode) {
    case Mode::none:
      return "none";
    case Mode::nccl:
      return "nccl";
    case Mode::ce:
      return "ce";
    case Mode::ce_staged:
      return "ce-staged";
  }
  return "?";
}

struct Timing {
  double work_ms = 0;
  double step_ms = 0;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

class Bench {
 public:
  Bench(const Options& options, const d9d::ProcessGroup& group)
      : options_(options),
        group_(group),
        compute_(c10::cuda::getStreamFromPool(false, group.device().index())) {
    numel_ = static_cast<int64_t>(options.grad_gb * 1e9 / sizeof(float));
    const auto bucket = static_cast<int64_t>(options.bucket_mb * 1e6 / sizeof(float));
    for (int64_t offset = 0; offset < numel_; offset += bucket) {
      buckets_.push_back({offset, std::min(bucket, numel_ - offset)});
    }
    ce_.emplace(group, numel_ * static_cast<int64_t>(sizeof(float)),
                bucket * static_cast<int64_t>(sizeof(float)));
    shared_ = ce_->buffer().view(at::kFloat);
    grads_ = at::empty({numel_}, shared_.options());

    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(group.device());
    x_ = at::randn({options.tokens, options.hidden}, bf16);
    w_ = at::randn({options.hidden, options.ffn}, bf16).div_(32);
    y_ = at::empty({options.tokens, options.ffn}, bf16);
    z_ = at::empty({options.tokens, options.ffn}, bf16);
  }

  // The ce modes' sums against NCCL's, on rank-dependent gradients.
  void verify() {
    const c10::cuda::CUDAStreamGuard guard(compute_);
    const auto input = at::randn({numel_}, shared_.options()).mul_(group_.rank() + 1);
    grads_.copy_(input);
    reduce_all(Mode::nccl);
    const auto expected = grads_.clone();
    for (const Mode mode : {Mode::ce, Mode::ce_staged}) {
      shared_.copy_(input);
      grads_.copy_(input);
      if (mode == Mode::ce_staged) {
        shared_.zero_();
      }
      reduce_all(mode);
      const auto& result = mode == Mode::ce ? shared_ : grads_;
      const double error = (result - expected).abs().max().item<double>();
      std::printf("[rank %d] %s: max |sum - nccl's| = %.3g\n", group_.rank(), name_of(mode), error);
      if (error > 1e-4) {
        throw std::runtime_error("copy-engine sums differ from NCCL's");
      }
    }
  }

  Timing run(Mode mode, bool work) {
    std::vector<double> work_ms;
    std::vector<double> step_ms;
    for (int iteration = 0; iteration < options_.warmup + options_.iterations; ++iteration) {
      group_.barrier();
      const auto [w, s] = step(mode, work);
      if (iteration >= options_.warmup) {
        work_ms.push_back(w);
        step_ms.push_back(s);
      }
    }
    return {work ? median(work_ms) : 0.0, median(step_ms)};
  }

 private:
  // All buckets, then the wait (verification; no workload).
  void reduce_all(Mode mode) {
    for (const auto& bucket : buckets_) {
      launch(mode, bucket);
    }
    finish(mode);
  }

  void launch(Mode mode, const Bucket& bucket) {
    if (mode == Mode::none) {
      return;
    }
    if (mode == Mode::nccl) {
      std::vector<at::Tensor> tensors{grads_.narrow(0, bucket.offset, bucket.numel)};
      works_.push_back(group_.backend()->allreduce(tensors));
      return;
    }
    ce_->on_side([&] {
      auto shared = shared_.narrow(0, bucket.offset, bucket.numel);
      auto grads = grads_.narrow(0, bucket.offset, bucket.numel);
      if (mode == Mode::ce_staged) {
        shared.copy_(grads);
      }
      ce_->sum(bucket.offset * static_cast<int64_t>(sizeof(float)), bucket.numel, at::kFloat);
      if (mode == Mode::ce_staged) {
        grads.copy_(shared);
      }
    });
  }

  // The compute stream waits for every bucket's reduction.
  void finish(Mode mode) {
    if (mode == Mode::none) {
      return;
    }
    if (mode == Mode::nccl) {
      for (auto& work : works_) {
        work->wait();  // the current (compute) stream waits on NCCL's
      }
      works_.clear();
      return;
    }
    ce_->on_side([&] { ce_->end_of_step(); });
    ce_->join();
  }

  std::pair<double, double> step(Mode mode, bool work) {
    const c10::cuda::CUDAStreamGuard guard(compute_);
    at::cuda::CUDAEvent start(cudaEventDefault);
    at::cuda::CUDAEvent work_end(cudaEventDefault);
    at::cuda::CUDAEvent end(cudaEventDefault);
    start.record(compute_);
    std::size_t next = 0;
    const auto per_layer = static_cast<double>(numel_) / options_.layers;
    for (int layer = 0; layer < options_.layers; ++layer) {
      if (work) {
        for (int g = 0; g < options_.gemms; ++g) {
          at::mm_out(y_, x_, w_);
        }
        for (int e = 0; e < options_.elementwise; ++e) {
          at::mul_out(z_, y_, at::sigmoid(y_));
        }
      }
      // This layer's share of the gradients is ready.
      const auto ready = static_cast<int64_t>(per_layer * (layer + 1));
      while (next < buckets_.size() && (buckets_[next].offset + buckets_[next].numel <= ready ||
                                        layer + 1 == options_.layers)) {
        launch(mode, buckets_[next++]);
      }
    }
    work_end.record(compute_);
    finish(mode);
    end.record(compute_);
    end.synchronize();
    return {start.elapsed_time(work_end), start.elapsed_time(end)};
  }

  Options options_;
  d9d::ProcessGroup group_;
  c10::cuda::CUDAStream compute_;
  int64_t numel_ = 0;
  std::vector<Bucket> buckets_;
  std::optional<d9d::parallel::detail::CopyEngineReduce> ce_;
  at::Tensor shared_;  // the copy engine's buffer as float32
  at::Tensor grads_;
  at::Tensor x_, w_, y_, z_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"Gradient all-reduce beside a backward-like workload: NCCL against copy engines"};
  app.add_option("--layers", options.layers);
  app.add_option("--gemms", options.gemms, "GEMMs per layer");
  app.add_option("--elementwise", options.elementwise, "elementwise passes per layer");
  app.add_option("--tokens", options.tokens);
  app.add_option("--hidden", options.hidden);
  app.add_option("--ffn", options.ffn);
  app.add_option("--grad-gb", options.grad_gb, "float32 gradient bytes per step, in GB");
  app.add_option("--bucket-mb", options.bucket_mb);
  app.add_option("--warmup", options.warmup);
  app.add_option("--iterations", options.iterations);
  CLI11_PARSE(app, argc, argv);

  try {
    const auto context = d9d::DistributedContext::from_env({.device = "cuda"});
    const auto& group = context.world();
    if (group.size() < 2) {
      std::fprintf(stderr, "start 2+ ranks, one per GPU (tools/d9drun -n 2 ...)\n");
      return 2;
    }
    Bench bench(options, group);
    bench.verify();
    const bool main_rank = group.rank() == 0;
    if (main_rank) {
      std::printf("%-10s %-7s %10s %10s\n", "mode", "work", "work ms", "step ms");
    }
    for (const Mode mode : {Mode::none, Mode::nccl, Mode::ce, Mode::ce_staged}) {
      for (const bool work : {true, false}) {
        if (mode == Mode::none && !work) {
          continue;
        }
        const auto timing = bench.run(mode, work);
        if (main_rank) {
          std::printf("%-10s %-7s %10.2f %10.2f\n", name_of(mode), work ? "+ work" : "alone",
                      timing.work_ms, timing.step_ms);
        }
      }
    }
    const auto again = bench.run(Mode::none, true);
    if (main_rank) {
      std::printf("(work alone again: %.2f ms)\n", again.work_ms);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  }
  return 0;
}

#else  // without CUDA

#include <cstdio>

int main() {
  std::fprintf(stderr, "copy_engine_reduce_bench needs a CUDA build (CMake with CUDA)\n");
  return 2;
}

#endif
