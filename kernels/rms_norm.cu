// d9d/kernels/rms_norm.cu — CUDA kernels of d9d::rms_norm_forward / d9d::rms_norm_backward.
//
// One row (the normalised last dimension) per group of `tpr` threads, `rpb` rows per 256-thread
// block, rows visited grid-stride, 16-byte vector loads when the row is aligned. Rows of up to
// 1024 vectors are kept in registers (kCachedVecs per thread) so x and dy are read from memory
// once; longer rows are streamed twice. A cached row gets the fewest threads that hold it (a power
// of two, from 1): short rows (per-head QK-norm's 128 values) share a warp, and a row group within
// one warp sums by shuffles alone. Sums are in float (double for double inputs). The backward
// pass accumulates grad_weight per row group, sums the groups sharing a warp by shuffles and
// writes one partial row per warp (per row group when groups span warps); a column-sum kernel
// over those partials gives grad_weight. The input, weight and output may differ in dtype
// (d9d/kernels/rms_norm.hpp lists how): the weight is read, and its gradient written, in its own.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <d9d/kernels/detail/rms_norm.hpp>

namespace d9d::kernels {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kCachedVecs = 4;  // vectors per thread kept in registers on the cached path
constexpr int kWarp = 32;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// Sum over `width` aligned lanes (a power of two up to 32) by shuffles.
template <typename A>
__device__ __forceinline__ A lanes_sum(A v, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffU, v, offset);
  }
  return v;
}

// Sum over the blockDim.x threads of one row group (threadIdx.y selects the group). All threads of
// the block must call it (blockDim.x is uniform, so the branch is too). A group within one warp
// (blockDim.x <= 32: lanes blockDim.x-aligned) sums by shuffles alone; wider groups add their
// warps' sums through `scratch`, which holds blockDim.y * 32 values.
template <typename A>
__device__ __forceinline__ A row_sum(A v, A* scratch) {
  v = lanes_sum(v, min(static_cast<int>(blockDim.x), kWarp));
  if (blockDim.x <= kWarp) {
    return v;
  }
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  A* mine = scratch + threadIdx.y * kWarp;
  if (lane == 0) {
    mine[warp] = v;
  }
  __syncthreads();
  A total = lane < warps ? mine[lane] : A(0);
  total = lanes_sum(total, kWarp);
  __syncthreads();  // scratch is reused by the next row
  return total;
}

// kCached: the row fits in registers (nvec <= blockDim.x * kCachedVecs) and is read once;
// otherwise the row is streamed twice from memory (any length).
template <typename T, typename W, typename O, int VEC, bool kCached>
__global__ void __launch_bounds__(kThreadsPerBlock)
    rms_norm_forward_kernel(const T* __restrict__ x, const W* __restrict__ w, O* __restrict__ y,
                            at::opmath_type<T>* __restrict__ rstd, std::int64_t rows,
                            std::int64_t n, float eps) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  using VW = Vec<W, VEC>;
  using VO = Vec<O, VEC>;
  constexpr int kSlots = kCached ? kCachedVecs : 1;
  __shared__ A scratch[kThreadsPerBlock];
  const std::int64_t nvec = n / VEC;
  const std::int64_t tpr = blockDim.x;
  const VW* wv = reinterpret_cast<const VW*>(w);
  for (std::int64_t base = std::int64_t(blockIdx.x) * blockDim.y; base < rows;
       base += std::int64_t(gridDim.x) * blockDim.y) {
    const std::int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const V* xv = reinterpret_cast<const V*>(x + (valid ? row : 0) * n);
    V cache[kSlots];
    A sum_sq = 0;
    if constexpr (kCached) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (valid && i < nvec) {
          cache[k] = xv[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (valid && i < nvec) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const A v = static_cast<A>(cache[k].val[e]);
            sum_sq += v * v;
          }
        }
      }
    } else {
      for (std::int64_t i = threadIdx.x; valid && i < nvec; i += tpr) {
        const V v = xv[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A f = static_cast<A>(v.val[e]);
          sum_sq += f * f;
        }
      }
    }
    const A total = row_sum(sum_sq, scratch);
    if (!valid) {
      continue;
    }
    const A rs = A(1) / sqrt(total / static_cast<A>(n) + static_cast<A>(eps));
    if (threadIdx.x == 0) {
      rstd[row] = rs;
    }
    VO* yv = reinterpret_cast<VO*>(y + row * n);
    const auto write = [&](std::int64_t i, const V& xk) {
      const VW wk = wv[i];
      VO out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        out.val[e] = static_cast<O>(static_cast<A>(xk.val[e]) * rs * static_cast<A>(wk.val[e]));
      }
      yv[i] = out;
    };
    if constexpr (kCached) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (i < nvec) {
          write(i, cache[k]);
        }
      }
    } else {
      for (std::int64_t i = threadIdx.x; i < nvec; i += tpr) {
        write(i, xv[i]);
      }
    }
  }
}

// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)); each row group accumulates dy*xhat for its columns
// into its own row of `dw_partial` (registers on the cached path, memory otherwise; zero-filled).
// Two blocks per SM at least (at most 128 registers a thread): at 151 registers, one 256-thread
// block per SM, the wide rows' backward ran 25% slower on an H200.
template <typename T, typename W, typename O, int VEC, bool kCached>
__global__ void __launch_bounds__(kThreadsPerBlock, 2)
    rms_norm_backward_kernel(const O* __restrict__ dy, const T* __restrict__ x,
                             const W* __restrict__ w, const at::opmath_type<T>* __restrict__ rstd,
                             T* __restrict__ dx, at::opmath_type<T>* __restrict__ dw_partial,
                             std::int64_t rows, std::int64_t n) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  using VW = Vec<W, VEC>;
  using VO = Vec<O, VEC>;
  constexpr int kSlots = kCached ? kCachedVecs : 1;
  __shared__ A scratch[kThreadsPerBlock];
  const std::int64_t nvec = n / VEC;
  const std::int64_t tpr = blockDim.x;
  const VW* wv = reinterpret_cast<const VW*>(w);
  // Row groups sharing a warp (groups of fewer than 32 threads) share one partial row: the first
  // group of the warp writes their sum. Wider groups have one each, written whole by its own
  // threads (each the elements it accumulates), so the buffer needs no zeroing launch.
  const int per_warp = blockDim.x < kWarp ? kWarp / static_cast<int>(blockDim.x) : 1;
  A* partial = dw_partial +
               (std::int64_t(blockIdx.x) * (blockDim.y / per_warp) + threadIdx.y / per_warp) * n;
  A dw_acc[kSlots][VEC];
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      dw_acc[k][e] = 0;
    }
  }
  if constexpr (!kCached) {
    for (std::int64_t i = threadIdx.x; i < nvec; i += tpr) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        partial[i * VEC + e] = 0;
      }
    }
  }
  for (std::int64_t base = std::int64_t(blockIdx.x) * blockDim.y; base < rows;
       base += std::int64_t(gridDim.x) * blockDim.y) {
    const std::int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const std::int64_t off = (valid ? row : 0) * n;
    const V* xv = reinterpret_cast<const V*>(x + off);
    const VO* dyv = reinterpret_cast<const VO*>(dy + off);
    const A rs = valid ? rstd[row] : A(0);
    V xc[kSlots];
    VO gc[kSlots];
    A dot = 0;
    // Adds this element pair's share to the row's dot product and to grad_weight.
    const auto accumulate = [&](const V& xk, const VO& gk, const VW& wk, A* dw) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A xe = static_cast<A>(xk.val[e]);
        const A ge = static_cast<A>(gk.val[e]);
        dot += ge * static_cast<A>(wk.val[e]) * xe;
        dw[e] += ge * xe * rs;
      }
    };
    if constexpr (kCached) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (valid && i < nvec) {
          xc[k] = xv[i];
          gc[k] = dyv[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (valid && i < nvec) {
          accumulate(xc[k], gc[k], wv[i], dw_acc[k]);
        }
      }
    } else {
      for (std::int64_t i = threadIdx.x; valid && i < nvec; i += tpr) {
        A dw[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          dw[e] = 0;
        }
        accumulate(xv[i], dyv[i], wv[i], dw);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          partial[i * VEC + e] += dw[e];
        }
      }
    }
    const A total = row_sum(dot, scratch);
    if (!valid) {
      continue;
    }
    const A c = total * rs * rs / static_cast<A>(n);
    V* dxv = reinterpret_cast<V*>(dx + off);
    const auto write = [&](std::int64_t i, const V& xk, const VO& gk) {
      const VW wk = wv[i];
      V out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A g = static_cast<A>(gk.val[e]) * static_cast<A>(wk.val[e]);
        out.val[e] = static_cast<T>(rs * (g - static_cast<A>(xk.val[e]) * c));
      }
      dxv[i] = out;
    };
    if constexpr (kCached) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const std::int64_t i = threadIdx.x + k * tpr;
        if (i < nvec) {
          write(i, xc[k], gc[k]);
        }
      }
    } else {
      for (std::int64_t i = threadIdx.x; i < nvec; i += tpr) {
        write(i, xv[i], dyv[i]);
      }
    }
  }
  if constexpr (kCached) {
    // The warp's groups hold the same columns in the same lanes of each group: add them up. The
    // offsets are compile-time (those inside a group skipped): a loop from blockDim.x took the
    // kernel to 151 registers.
#pragma unroll
    for (int offset = 1; offset < kWarp; offset *= 2) {
      if (offset < static_cast<int>(blockDim.x)) {
        continue;
      }
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          dw_acc[k][e] += __shfl_xor_sync(0xffffffffU, dw_acc[k][e], offset);
        }
      }
    }
    if (threadIdx.y % per_warp != 0) {
      return;
    }
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const std::int64_t i = threadIdx.x + k * tpr;
      if (i < nvec) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          partial[i * VEC + e] = dw_acc[k][e];
        }
      }
    }
  }
}

// grad_weight[j] = the sum of partial[:, j] over the row groups' partial rows: each block sums 32
// columns with 8 lanes of threads down the rows, then the lanes in shared memory, and writes the
// weight's dtype (one launch for what was a sum and a cast).
template <typename A, typename W>
__global__ void __launch_bounds__(kThreadsPerBlock)
    column_sum_kernel(const A* __restrict__ partial, W* __restrict__ out, std::int64_t parts,
                      std::int64_t n) {
  constexpr int kLanes = kThreadsPerBlock / kWarp;
  __shared__ A lanes[kLanes][kWarp];
  const std::int64_t col = std::int64_t(blockIdx.x) * kWarp + threadIdx.x;
  A sum = 0;
  if (col < n) {
    for (std::int64_t p = threadIdx.y; p < parts; p += kLanes) {
      sum += partial[p * n + col];
    }
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    A total = 0;
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      total += lanes[k][threadIdx.x];
    }
    out[col] = static_cast<W>(total);
  }
}

// Launch geometry for rows of `n` elements.
struct Geometry {
  int vec = 1;         // elements per vector (1 when unaligned): 16 bytes of the input
  bool cached = true;  // the row fits in registers
  int tpr = kWarp;     // threads per row, a power of two (under 32 for short cached rows)
  int rpb = 1;         // rows per block
  // Partial grad_weight rows per block: one per warp when row groups share warps.
  [[nodiscard]] int partials_per_block() const { return tpr < kWarp ? rpb / (kWarp / tpr) : rpb; }
};

// A pointer the kernel reads or writes in vectors of `vec` elements of `size` bytes.
struct Access {
  const void* ptr;
  std::size_t size;
};

Geometry pick_geometry(std::int64_t n, std::size_t input_size,
                       std::initializer_list<Access> accesses) {
  Geometry g;
  const int max_vec = static_cast<int>(16 / input_size);
  bool aligned = n % max_vec == 0;
  for (const auto& a : accesses) {
    aligned = aligned && reinterpret_cast<std::uintptr_t>(a.ptr) % (a.size * max_vec) == 0;
  }
  g.vec = aligned ? max_vec : 1;
  const std::int64_t nvec = n / g.vec;
  g.cached = nvec <= std::int64_t(kThreadsPerBlock) * kCachedVecs;
  if (g.cached) {
    g.tpr = 1;
    while (std::int64_t(g.tpr) * kCachedVecs < nvec) {
      g.tpr *= 2;
    }
  } else {
    g.tpr = kThreadsPerBlock;
  }
  g.rpb = kThreadsPerBlock / g.tpr;
  return g;
}

// Calls `fn` with the kernel variant's compile-time (VEC, cached) for geometry `g`.
template <typename T, typename Fn>
void with_variant(const Geometry& g, Fn&& fn) {
  constexpr int kVec = 16 / sizeof(T);
  if (g.vec == kVec) {
    g.cached ? fn(std::integral_constant<int, kVec>{}, std::true_type{})
             : fn(std::integral_constant<int, kVec>{}, std::false_type{});
  } else {
    g.cached ? fn(std::integral_constant<int, 1>{}, std::true_type{})
             : fn(std::integral_constant<int, 1>{}, std::false_type{});
  }
}

std::vector<std::int64_t> row_shape(const at::Tensor& input) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  return sizes;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input_arg,
                                                         const at::Tensor& weight_arg, double eps,
                                                         std::optional<at::ScalarType> out_dtype) {
  const auto out = detail::rms_norm_output_dtype(input_arg, out_dtype);
  const auto shape = detail::check_rms_norm_forward(input_arg, weight_arg, out);
  const c10::cuda::CUDAGuard guard(input_arg.device());
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor weight = weight_arg.contiguous();
  at::Tensor output = at::empty_like(input, input.options().dtype(out));
  at::Tensor rstd = at::empty(row_shape(input),
                              input.options().dtype(detail::accumulate_dtype(input.scalar_type())));
  if (shape.rows == 0 || shape.cols == 0) {
    rstd.fill_(0);
    return {output, rstd};
  }
  detail::dispatch_rms_norm_types(
      input.scalar_type(), weight.scalar_type(), out, [&](auto t, auto w_t, auto o_t) {
        using T = decltype(t);
        using W = decltype(w_t);
        using O = decltype(o_t);
        using A = at::opmath_type<T>;
        const Geometry g = pick_geometry(shape.cols, sizeof(T),
                                         {{input.const_data_ptr(), sizeof(T)},
                                          {weight.const_data_ptr(), sizeof(W)},
                                          {output.const_data_ptr(), sizeof(O)}});
        const dim3 block(g.tpr, g.rpb);
        const auto blocks = (shape.rows + g.rpb - 1) / g.rpb;
        const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>(blocks, 1 << 30)));
        with_variant<T>(g, [&](auto vec, auto cached) {
          rms_norm_forward_kernel<T, W, O, decltype(vec)::value, decltype(cached)::value>
              <<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
                  input.const_data_ptr<T>(), weight.const_data_ptr<W>(),
                  output.mutable_data_ptr<O>(), rstd.mutable_data_ptr<A>(), shape.rows, shape.cols,
                  static_cast<float>(eps));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {output, rstd};
}

// Two launches: the row kernel (grad_input, and a partial grad_weight per row group) and the
// column sum of the partials into grad_weight, in the weight's dtype.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_arg,
                                                          const at::Tensor& input_arg,
                                                          const at::Tensor& weight_arg,
                                                          const at::Tensor& rstd_arg) {
  const auto shape = detail::check_rms_norm_backward(grad_arg, input_arg, weight_arg, rstd_arg);
  const c10::cuda::CUDAGuard guard(input_arg.device());
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor weight = weight_arg.contiguous();
  const at::Tensor rstd = rstd_arg.contiguous();
  at::Tensor grad_input = at::empty_like(input);
  if (shape.rows == 0 || shape.cols == 0) {
    return {grad_input, at::zeros_like(weight)};
  }
  at::Tensor grad_weight = at::empty_like(weight);
  detail::dispatch_rms_norm_types(
      input.scalar_type(), weight.scalar_type(), grad.scalar_type(),
      [&](auto t, auto w_t, auto o_t) {
        using T = decltype(t);
        using W = decltype(w_t);
        using O = decltype(o_t);
        using A = at::opmath_type<T>;
        const Geometry g = pick_geometry(shape.cols, sizeof(T),
                                         {{grad.const_data_ptr(), sizeof(O)},
                                          {input.const_data_ptr(), sizeof(T)},
                                          {weight.const_data_ptr(), sizeof(W)},
                                          {grad_input.const_data_ptr(), sizeof(T)}});
        const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
        const std::int64_t needed = (shape.rows + g.rpb - 1) / g.rpb;
        const int blocks = static_cast<int>(std::min<std::int64_t>(needed, 2LL * sms));
        const std::int64_t parts = std::int64_t(blocks) * g.partials_per_block();
        at::Tensor partial = at::empty({parts, shape.cols}, rstd.options());
        const auto stream = at::cuda::getCurrentCUDAStream();
        const dim3 block(g.tpr, g.rpb);
        with_variant<T>(g, [&](auto vec, auto cached) {
          rms_norm_backward_kernel<T, W, O, decltype(vec)::value, decltype(cached)::value>
              <<<blocks, block, 0, stream>>>(grad.const_data_ptr<O>(), input.const_data_ptr<T>(),
                                             weight.const_data_ptr<W>(), rstd.const_data_ptr<A>(),
                                             grad_input.mutable_data_ptr<T>(),
                                             partial.mutable_data_ptr<A>(), shape.rows, shape.cols);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
        const auto columns = static_cast<unsigned>((shape.cols + kWarp - 1) / kWarp);
        column_sum_kernel<A, W><<<columns, dim3(kWarp, kThreadsPerBlock / kWarp), 0, stream>>>(
            partial.const_data_ptr<A>(), grad_weight.mutable_data_ptr<W>(), parts, shape.cols);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("rms_norm_forward", &d9d::kernels::rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &d9d::kernels::rms_norm_backward_cuda);
}
