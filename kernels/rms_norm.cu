// d9d/kernels/rms_norm.cu — CUDA kernels of d9d::rms_norm_forward / d9d::rms_norm_backward.
//
// One row (the normalised last dimension) per group of `tpr` threads, `rpb` rows per block, rows
// visited grid-stride. Each thread keeps its slice of the row in registers (up to kMaxVecs vectors
// of 16 bytes), so x and dy are read from memory once; sums are in float (double for double).
// The backward pass accumulates each block's share of grad_weight in registers and writes one
// partial row per row-group; a sum over those partials gives grad_weight.
#include <algorithm>
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <d9d/kernels/detail/rms_norm.hpp>

namespace d9d::kernels {
namespace {

constexpr int kMaxVecs = 8;        // vectors per thread kept in registers
constexpr int kMaxThreads = 1024;  // threads per row at most
constexpr int kWarp = 32;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffU, v, offset);
  }
  return v;
}

// Sum over the `tpr` threads of one row group (threadIdx.y selects the group). All threads of the
// block must call it. `scratch` holds blockDim.y * 32 values.
template <typename A>
__device__ __forceinline__ A row_sum(A v, A* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  A* mine = scratch + threadIdx.y * kWarp;
  v = warp_sum(v);
  if (lane == 0) {
    mine[warp] = v;
  }
  __syncthreads();
  A total = lane < warps ? mine[lane] : A(0);
  total = warp_sum(total);
  __syncthreads();  // scratch may be reused right after
  return total;
}

template <typename T, int VEC>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                        T* __restrict__ y, at::opmath_type<T>* __restrict__ rstd,
                                        std::int64_t rows, std::int64_t n, float eps) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  __shared__ A scratch[kMaxThreads];
  const std::int64_t nvec = n / VEC;
  const V* wv = reinterpret_cast<const V*>(w);
  for (std::int64_t base = std::int64_t(blockIdx.x) * blockDim.y; base < rows;
       base += std::int64_t(gridDim.x) * blockDim.y) {
    const std::int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const V* xv = reinterpret_cast<const V*>(x + (valid ? row : 0) * n);
    V cache[kMaxVecs];
    A sum_sq = 0;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const std::int64_t i = threadIdx.x + std::int64_t(k) * blockDim.x;
      if (valid && i < nvec) {
        cache[k] = xv[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A v = static_cast<A>(cache[k].val[e]);
          sum_sq += v * v;
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
    V* yv = reinterpret_cast<V*>(y + row * n);
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const std::int64_t i = threadIdx.x + std::int64_t(k) * blockDim.x;
      if (i < nvec) {
        const V wk = wv[i];
        V out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          out.val[e] =
              static_cast<T>(static_cast<A>(cache[k].val[e]) * rs * static_cast<A>(wk.val[e]));
        }
        yv[i] = out;
      }
    }
  }
}

template <typename T, int VEC>
__global__ void rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                         const T* __restrict__ w,
                                         const at::opmath_type<T>* __restrict__ rstd,
                                         T* __restrict__ dx,
                                         at::opmath_type<T>* __restrict__ dw_partial,
                                         std::int64_t rows, std::int64_t n) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  __shared__ A scratch[kMaxThreads];
  const std::int64_t nvec = n / VEC;
  const V* wv = reinterpret_cast<const V*>(w);
  A dw_acc[kMaxVecs][VEC];
#pragma unroll
  for (int k = 0; k < kMaxVecs; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      dw_acc[k][e] = 0;
    }
  }
  for (std::int64_t base = std::int64_t(blockIdx.x) * blockDim.y; base < rows;
       base += std::int64_t(gridDim.x) * blockDim.y) {
    const std::int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    const std::int64_t off = (valid ? row : 0) * n;
    const V* xv = reinterpret_cast<const V*>(x + off);
    const V* dyv = reinterpret_cast<const V*>(dy + off);
    const A rs = valid ? rstd[row] : A(0);
    V xc[kMaxVecs];
    V gc[kMaxVecs];
    A dot = 0;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const std::int64_t i = threadIdx.x + std::int64_t(k) * blockDim.x;
      if (valid && i < nvec) {
        xc[k] = xv[i];
        gc[k] = dyv[i];
        const V wk = wv[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A xe = static_cast<A>(xc[k].val[e]);
          const A ge = static_cast<A>(gc[k].val[e]);
          dot += ge * static_cast<A>(wk.val[e]) * xe;
          dw_acc[k][e] += ge * xe * rs;
        }
      }
    }
    const A total = row_sum(dot, scratch);
    if (!valid) {
      continue;
    }
    const A c = total * rs * rs / static_cast<A>(n);
    V* dxv = reinterpret_cast<V*>(dx + off);
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const std::int64_t i = threadIdx.x + std::int64_t(k) * blockDim.x;
      if (i < nvec) {
        const V wk = wv[i];
        V out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A g = static_cast<A>(gc[k].val[e]) * static_cast<A>(wk.val[e]);
          out.val[e] = static_cast<T>(rs * (g - static_cast<A>(xc[k].val[e]) * c));
        }
        dxv[i] = out;
      }
    }
  }
  // One partial grad_weight row per row group of this block.
  A* partial = dw_partial + (std::int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * n;
#pragma unroll
  for (int k = 0; k < kMaxVecs; ++k) {
    const std::int64_t i = threadIdx.x + std::int64_t(k) * blockDim.x;
    if (i < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        partial[i * VEC + e] = dw_acc[k][e];
      }
    }
  }
}

// Launch geometry for a row of `n` elements.
struct Geometry {
  int vec = 1;
  int tpr = kWarp;  // threads per row, a multiple of 32
  int rpb = 1;      // rows per block
};

Geometry pick_geometry(std::int64_t n, std::size_t elem_size, const void* const* ptrs, int count) {
  Geometry g;
  const int max_vec = static_cast<int>(16 / elem_size);
  bool aligned = n % max_vec == 0;
  for (int i = 0; i < count; ++i) {
    aligned = aligned && reinterpret_cast<std::uintptr_t>(ptrs[i]) % 16 == 0;
  }
  g.vec = aligned ? max_vec : 1;
  const std::int64_t nvec = n / g.vec;
  const std::int64_t per_thread = (nvec + kMaxThreads - 1) / kMaxThreads;
  TORCH_CHECK(per_thread <= kMaxVecs, "d9d::rms_norm (CUDA): rows of ", n, " elements are longer ",
              "than this kernel supports (", std::int64_t(kMaxThreads) * kMaxVecs * g.vec,
              " for this dtype and alignment)");
  // Fewest threads that cover the row with at most kMaxVecs vectors each, at least 2 per thread
  // when the row is long (keeps blocks small enough for several per SM).
  std::int64_t tpr = kWarp;
  while (tpr < kMaxThreads && tpr * kMaxVecs / 4 < nvec) {
    tpr *= 2;
  }
  g.tpr = static_cast<int>(tpr);
  g.rpb = std::max(1, 256 / g.tpr);
  return g;
}

template <typename T, int VEC>
void launch_forward(const Geometry& g, std::int64_t rows, std::int64_t n, const at::Tensor& input,
                    const at::Tensor& weight, at::Tensor& output, at::Tensor& rstd, double eps) {
  using A = at::opmath_type<T>;
  const dim3 block(g.tpr, g.rpb);
  const std::int64_t blocks = (rows + g.rpb - 1) / g.rpb;
  const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>(blocks, 1 << 30)));
  rms_norm_forward_kernel<T, VEC><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
      input.const_data_ptr<T>(), weight.const_data_ptr<T>(), output.mutable_data_ptr<T>(),
      rstd.mutable_data_ptr<A>(), rows, n, static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int VEC>
void launch_backward(const Geometry& g, std::int64_t rows, std::int64_t n, const at::Tensor& grad,
                     const at::Tensor& input, const at::Tensor& weight, const at::Tensor& rstd,
                     at::Tensor& grad_input, at::Tensor& partial, int blocks) {
  using A = at::opmath_type<T>;
  const dim3 block(g.tpr, g.rpb);
  rms_norm_backward_kernel<T, VEC><<<blocks, block, 0, at::cuda::getCurrentCUDAStream()>>>(
      grad.const_data_ptr<T>(), input.const_data_ptr<T>(), weight.const_data_ptr<T>(),
      rstd.const_data_ptr<A>(), grad_input.mutable_data_ptr<T>(), partial.mutable_data_ptr<A>(),
      rows, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<std::int64_t> row_shape(const at::Tensor& input) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  return sizes;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input_arg,
                                                         const at::Tensor& weight_arg, double eps) {
  const auto shape = detail::check_rms_norm_forward(input_arg, weight_arg);
  const c10::cuda::CUDAGuard guard(input_arg.device());
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor weight = weight_arg.contiguous();
  at::Tensor output = at::empty_like(input);
  at::Tensor rstd = at::empty(row_shape(input),
                              input.options().dtype(detail::accumulate_dtype(input.scalar_type())));
  if (shape.rows == 0 || shape.cols == 0) {
    rstd.fill_(0);
    return {output, rstd};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "d9d::rms_norm_forward_cuda", [&] {
        const void* ptrs[] = {input.const_data_ptr(), weight.const_data_ptr(),
                              output.const_data_ptr()};
        const Geometry g = pick_geometry(shape.cols, sizeof(scalar_t), ptrs, 3);
        constexpr int kVec = 16 / sizeof(scalar_t);
        if (g.vec == kVec) {
          launch_forward<scalar_t, kVec>(g, shape.rows, shape.cols, input, weight, output, rstd,
                                         eps);
        } else {
          launch_forward<scalar_t, 1>(g, shape.rows, shape.cols, input, weight, output, rstd, eps);
        }
      });
  return {output, rstd};
}

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
  at::Tensor grad_weight;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, input.scalar_type(), "d9d::rms_norm_backward_cuda", [&] {
        const void* ptrs[] = {grad.const_data_ptr(), input.const_data_ptr(),
                              weight.const_data_ptr(), grad_input.const_data_ptr()};
        const Geometry g = pick_geometry(shape.cols, sizeof(scalar_t), ptrs, 4);
        const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
        const std::int64_t needed = (shape.rows + g.rpb - 1) / g.rpb;
        const int blocks = static_cast<int>(std::min<std::int64_t>(needed, 2LL * sms));
        at::Tensor partial = at::empty({std::int64_t(blocks) * g.rpb, shape.cols}, rstd.options());
        constexpr int kVec = 16 / sizeof(scalar_t);
        if (g.vec == kVec) {
          launch_backward<scalar_t, kVec>(g, shape.rows, shape.cols, grad, input, weight, rstd,
                                          grad_input, partial, blocks);
        } else {
          launch_backward<scalar_t, 1>(g, shape.rows, shape.cols, grad, input, weight, rstd,
                                       grad_input, partial, blocks);
        }
        grad_weight = partial.sum(0).to(weight.scalar_type());
      });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("rms_norm_forward", &d9d::kernels::rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &d9d::kernels::rms_norm_backward_cuda);
}
