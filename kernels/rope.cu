// d9d/kernels/rope.cu — CUDA kernel of d9d::rope_forward (rotary embedding, half-split layout).
//
// x is viewed as rows of D = 2 * half elements (row r at position (r / heads) % positions). Each
// thread rotates VEC consecutive pairs (i, i + half) of one row: two VEC-wide loads of x, VEC
// cosines and sines (float, read through the cache: the table is small and shared by every head),
// two VEC-wide stores. VEC = 16 bytes of x when half is a multiple of it and the pointers are
// aligned, else 1. Memory-bound: one read and one write of x.
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <d9d/kernels/rope.hpp>

namespace d9d::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

template <typename T, int VEC>
__global__ void rope_kernel(const T* __restrict__ x, const at::opmath_type<T>* __restrict__ cos,
                            const at::opmath_type<T>* __restrict__ sin, T* __restrict__ y,
                            std::int64_t rows, std::int64_t positions, std::int64_t heads,
                            std::int64_t half, bool inverse) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  const std::int64_t groups = half / VEC;  // VEC-wide groups of pairs per row
  const std::int64_t total = rows * groups;
  const A sign = inverse ? A(-1) : A(1);
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       item < total; item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = item / groups;
    const std::int64_t i = (item % groups) * VEC;
    const std::int64_t t = (row / heads) % positions;
    const std::int64_t base = row * 2 * half;
    const V a = *reinterpret_cast<const V*>(x + base + i);
    const V b = *reinterpret_cast<const V*>(x + base + half + i);
    V ya;
    V yb;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A c = __ldg(cos + t * half + i + k);
      const A s = sign * __ldg(sin + t * half + i + k);
      const auto x1 = static_cast<A>(a.val[k]);
      const auto x2 = static_cast<A>(b.val[k]);
      ya.val[k] = static_cast<T>(x1 * c - x2 * s);
      yb.val[k] = static_cast<T>(x2 * c + x1 * s);
    }
    *reinterpret_cast<V*>(y + base + i) = ya;
    *reinterpret_cast<V*>(y + base + half + i) = yb;
  }
}

bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

at::Tensor rope_forward_cuda(const at::Tensor& x_arg, const at::Tensor& cos_arg,
                             const at::Tensor& sin_arg, bool inverse) {
  const auto shape = detail::check_rope(x_arg, cos_arg, sin_arg);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor cos = cos_arg.contiguous();
  const at::Tensor sin = sin_arg.contiguous();
  at::Tensor y = at::empty_like(x);
  if (shape.rows == 0 || shape.half == 0) {
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "d9d::rope_forward_cuda", [&] {
        using A = at::opmath_type<scalar_t>;
        constexpr int kVec = 16 / sizeof(scalar_t);
        const bool vectorised = shape.half % kVec == 0 && aligned(x.const_data_ptr(), 16) &&
                                aligned(y.const_data_ptr(), 16);
        const auto launch = [&](auto vec) {
          constexpr int V = decltype(vec)::value;
          const std::int64_t total = shape.rows * (shape.half / V);
          const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
          const auto blocks = static_cast<int>(
              std::min<std::int64_t>((total + kThreads - 1) / kThreads, std::int64_t{sms} * 32));
          rope_kernel<scalar_t, V><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              x.const_data_ptr<scalar_t>(), cos.const_data_ptr<A>(), sin.const_data_ptr<A>(),
              y.mutable_data_ptr<scalar_t>(), shape.rows, shape.positions, shape.heads, shape.half,
              inverse);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (vectorised) {
          launch(std::integral_constant<int, kVec>{});
        } else {
          launch(std::integral_constant<int, 1>{});
        }
      });
  return y;
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) { m.impl("rope_forward", &d9d::kernels::rope_forward_cuda); }
