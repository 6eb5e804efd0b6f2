// d9d/kernels/cross_entropy.cu — CUDA kernel of d9d::cross_entropy_rows_.
//
// One block per row. Pass 1: each thread keeps an online (max, sum of exp) over its strided
// elements (16-byte loads when the row is aligned), then the block combines the pairs (warp
// shuffles, then one value per warp in shared memory) into the row's log-sum-exp. Pass 2 re-reads
// the row (mostly from L2: a 0.6B Qwen3 row of 151,936 bf16 logits is 297 KiB) and writes
// softmax - one-hot over it. Memory-bound: two reads and one write of the row in its own dtype.
#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <d9d/kernels/cross_entropy.hpp>

namespace d9d::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

__device__ __forceinline__ float exp_of(float x) { return __expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }

// Adds x to the running (max, sum of exp(v - max)).
template <typename A>
__device__ __forceinline__ void online_add(A x, A& max, A& sum) {
  if (x > max) {
    sum = sum * exp_of(max - x) + A(1);  // exp(-inf) = 0 for the first value
    max = x;
  } else if (x != -std::numeric_limits<A>::infinity()) {
    sum += exp_of(x - max);
  }
}

// Merges two running pairs.
template <typename A>
__device__ __forceinline__ void online_merge(A other_max, A other_sum, A& max, A& sum) {
  const A m = other_max > max ? other_max : max;
  if (m == -std::numeric_limits<A>::infinity()) {
    return;
  }
  sum = sum * exp_of(max - m) + other_sum * exp_of(other_max - m);
  max = m;
}

template <typename T, int VEC>
__global__ void cross_entropy_rows_kernel(T* __restrict__ logits,
                                          const std::int64_t* __restrict__ labels,
                                          at::opmath_type<T>* __restrict__ loss, std::int64_t vocab,
                                          std::int64_t ignore_index) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const std::int64_t row_index = blockIdx.x;
  T* row = logits + row_index * vocab;
  const std::int64_t target = labels[row_index];
  const std::int64_t vectors = vocab / VEC;  // VEC divides vocab when VEC > 1
  if (target == ignore_index) {
    V zero;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      zero.val[k] = T(0);
    }
    for (std::int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      reinterpret_cast<V*>(row)[v] = zero;
    }
    if (threadIdx.x == 0) {
      loss[row_index] = A(0);
    }
    return;
  }
  CUDA_KERNEL_ASSERT(target >= 0 && target < vocab);
  A max = kNegInf;
  A sum = A(0);
  for (std::int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    const V x = reinterpret_cast<const V*>(row)[v];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      online_add(static_cast<A>(x.val[k]), max, sum);
    }
  }
  // Block reduction of (max, sum).
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const A other_max = __shfl_xor_sync(0xFFFFFFFFU, max, offset);
    const A other_sum = __shfl_xor_sync(0xFFFFFFFFU, sum, offset);
    online_merge(other_max, other_sum, max, sum);
  }
  __shared__ A warp_max[kWarps];
  __shared__ A warp_sum[kWarps];
  __shared__ A row_lse;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) {
    warp_max[warp] = max;
    warp_sum[warp] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    A m = warp_max[0];
    A s = warp_sum[0];
    for (int w = 1; w < kWarps; ++w) {
      online_merge(warp_max[w], warp_sum[w], m, s);
    }
    const A lse = m + log(s);
    row_lse = lse;
    loss[row_index] = lse - static_cast<A>(row[target]);
  }
  __syncthreads();
  const A lse = row_lse;
  for (std::int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    V x = reinterpret_cast<const V*>(row)[v];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      A p = exp_of(static_cast<A>(x.val[k]) - lse);
      if (v * VEC + k == target) {
        p -= A(1);
      }
      x.val[k] = static_cast<T>(p);
    }
    reinterpret_cast<V*>(row)[v] = x;
  }
}

at::Tensor cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& labels_arg,
                                   std::int64_t ignore_index) {
  detail::check_cross_entropy_rows(logits, labels_arg);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor labels = labels_arg.contiguous();
  const std::int64_t rows = logits.size(0);
  const std::int64_t vocab = logits.size(1);
  const auto acc_type = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::empty({rows}, logits.options().dtype(acc_type));
  if (rows == 0 || vocab == 0) {
    return loss.zero_();
  }
  TORCH_CHECK(rows <= std::numeric_limits<int>::max(), "d9d::cross_entropy_rows_: ", rows,
              " rows in one call; split them");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "d9d::cross_entropy_rows_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        constexpr int kVec = 16 / sizeof(scalar_t);
        const bool vectorised =
            reinterpret_cast<std::uintptr_t>(logits.const_data_ptr()) % 16 == 0 &&
            vocab % kVec == 0;
        const auto stream = at::cuda::getCurrentCUDAStream();
        if (vectorised) {
          cross_entropy_rows_kernel<scalar_t, kVec>
              <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
                  logits.mutable_data_ptr<scalar_t>(), labels.const_data_ptr<std::int64_t>(),
                  loss.mutable_data_ptr<acc_t>(), vocab, ignore_index);
        } else {
          cross_entropy_rows_kernel<scalar_t, 1>
              <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
                  logits.mutable_data_ptr<scalar_t>(), labels.const_data_ptr<std::int64_t>(),
                  loss.mutable_data_ptr<acc_t>(), vocab, ignore_index);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return loss;
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("cross_entropy_rows_", &d9d::kernels::cross_entropy_rows_cuda);
}
