// d9d/kernels/moe_permute.cu — CUDA kernels of d9d::moe_route_indices, d9d::moe_permute_forward /
// _backward and d9d::moe_unpermute_forward / _backward (definitions: d9d/kernels/moe_permute.hpp).
//
// Routing, a stable counting sort in three launches and no host synchronisation:
//   1. route_histogram_kernel: one 256-thread block per chunk of kChunk pairs counts its pairs per
//      expert (shared-memory integer atomics) into hist[chunk][expert];
//   2. route_scan_kernel: one block turns hist into each chunk's start within each expert's run
//      (a scan over the chunks per expert), writes counts and kept counts, and scans the experts'
//      kept and dropped counts into their starts in `order`;
//   3. route_place_kernel: each chunk again, 256 pairs at a time in pair order: a pair's place in
//      its expert's run is its chunk's start + the pairs of its expert in earlier tiles of the
//      chunk
//      + those in earlier warps of its tile + those in earlier lanes of its warp
//      (__match_any_sync), so places increase with the pair index: stable, whatever the scheduling.
// Row kernels: one block per output row, 16-byte vectors when the rows allow. The sums over a
// token's pairs (moe_permute_backward, moe_unpermute_forward) are done by one block per token,
// which ranks the token's kept positions (at most top_k) in shared memory and adds the rows in
// increasing position in the op-math type, each product rounded first (__fmul_rn / __dmul_rn, so
// no multiply-add is fused): the CPU reference's order and roundings, bit for bit. No
// floating-point atomics.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <d9d/kernels/moe_permute.hpp>

namespace d9d::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kRouteThreads = 256;
constexpr int kRouteWarps = kRouteThreads / kWarp;
constexpr int kChunk = 1024;  // pairs per block of the histogram and the placement
constexpr int kScanThreads = 1024;
constexpr std::int64_t kMaxExperts = 4096;
constexpr int kRowThreads = 128;
constexpr std::size_t kDefaultSharedBytes = 48 * 1024;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// ---- routing -----------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRouteThreads)
    route_histogram_kernel(const std::int64_t* __restrict__ chosen, std::int64_t pairs, int experts,
                           int* __restrict__ hist) {
  extern __shared__ int s_count[];  // [experts]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    s_count[e] = 0;
  }
  __syncthreads();
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kChunk;
  const std::int64_t end = begin + kChunk < pairs ? begin + kChunk : pairs;
  for (std::int64_t p = begin + threadIdx.x; p < end; p += blockDim.x) {
    const std::int64_t e = chosen[p];
    CUDA_KERNEL_ASSERT(e >= 0 && e < experts);
    if (e >= 0 && e < experts) {
      atomicAdd(&s_count[e], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    hist[static_cast<std::int64_t>(blockIdx.x) * experts + e] = s_count[e];
  }
}

// Exclusive sum of one int per thread over the block; `total` gets the block's sum. All threads
// must call it. `scratch` holds kWarp + 1 ints.
__device__ __forceinline__ int block_exclusive_sum(int v, int* scratch, int& total) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  int inclusive = v;
#pragma unroll
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const int other = __shfl_up_sync(0xFFFFFFFFU, inclusive, offset);
    if (lane >= offset) {
      inclusive += other;
    }
  }
  if (lane == kWarp - 1) {
    scratch[warp] = inclusive;
  }
  __syncthreads();
  if (warp == 0) {
    const int mine = lane < warps ? scratch[lane] : 0;
    int running = mine;
#pragma unroll
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const int other = __shfl_up_sync(0xFFFFFFFFU, running, offset);
      if (lane >= offset) {
        running += other;
      }
    }
    if (lane < warps) {
      scratch[lane] = running - mine;
    }
    if (lane == kWarp - 1) {
      scratch[kWarp] = running;
    }
  }
  __syncthreads();
  const int result = scratch[warp] + inclusive - v;
  total = scratch[kWarp];
  __syncthreads();  // scratch is reused by the next call
  return result;
}

// base: [experts] kept starts, [experts] dropped starts (after the kept pairs), [1] kept total.
__global__ void __launch_bounds__(kScanThreads)
    route_scan_kernel(int* __restrict__ hist, int chunks, int experts, std::int64_t capacity,
                      std::int64_t* __restrict__ counts, std::int64_t* __restrict__ kept_counts,
                      int* __restrict__ base) {
  __shared__ int scratch[kWarp + 1];
  int kept_carry = 0;
  int dropped_carry = 0;
  for (int tile = 0; tile < experts; tile += kScanThreads) {
    const int e = tile + static_cast<int>(threadIdx.x);
    int count = 0;
    int kept = 0;
    if (e < experts) {
      for (int c = 0; c < chunks; ++c) {
        int* h = hist + static_cast<std::int64_t>(c) * experts + e;
        const int here = *h;
        *h = count;
        count += here;
      }
      kept = capacity < 0 || count <= capacity ? count : static_cast<int>(capacity);
      counts[e] = count;
      kept_counts[e] = kept;
    }
    int kept_tile = 0;
    int dropped_tile = 0;
    const int kept_start = block_exclusive_sum(kept, scratch, kept_tile);
    const int dropped_start = block_exclusive_sum(count - kept, scratch, dropped_tile);
    if (e < experts) {
      base[e] = kept_carry + kept_start;
      base[experts + e] = dropped_carry + dropped_start;
    }
    kept_carry += kept_tile;
    dropped_carry += dropped_tile;
  }
  if (threadIdx.x == 0) {
    base[2 * experts] = kept_carry;
  }
}

__global__ void __launch_bounds__(kRouteThreads)
    route_place_kernel(const std::int64_t* __restrict__ chosen, std::int64_t pairs, int experts,
                       std::int64_t top_k, std::int64_t capacity, const int* __restrict__ hist,
                       const int* __restrict__ base, std::int64_t* __restrict__ order,
                       std::int64_t* __restrict__ token, std::int64_t* __restrict__ position) {
  extern __shared__ int shared[];
  int* s_run = shared;             // [experts]: pairs of each expert in this chunk's earlier tiles
  int* s_warp = shared + experts;  // [kRouteWarps][experts]: this tile's pairs per warp and expert
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const unsigned lower_lanes = (1U << lane) - 1U;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    s_run[e] = 0;
  }
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kChunk;
  const std::int64_t end = begin + kChunk < pairs ? begin + kChunk : pairs;
  const int* chunk_start = hist + static_cast<std::int64_t>(blockIdx.x) * experts;
  const int kept_total = base[2 * experts];
  for (std::int64_t tile = begin; tile < end; tile += kRouteThreads) {
    for (int idx = threadIdx.x; idx < kRouteWarps * experts; idx += blockDim.x) {
      s_warp[idx] = 0;
    }
    __syncthreads();  // s_warp cleared; the previous tile's s_run additions done
    const std::int64_t p = tile + threadIdx.x;
    int e = -1;
    if (p < end) {
      const std::int64_t chosen_e = chosen[p];
      e = chosen_e >= 0 && chosen_e < experts ? static_cast<int>(chosen_e) : -1;
    }
    const unsigned peers = __match_any_sync(0xFFFFFFFFU, e);
    const int earlier_lanes = __popc(peers & lower_lanes);
    const bool leader = e >= 0 && earlier_lanes == 0;
    if (leader) {
      s_warp[warp * experts + e] = __popc(peers);
    }
    __syncthreads();
    if (e >= 0) {
      int local = s_run[e] + earlier_lanes;
      for (int w = 0; w < warp; ++w) {
        local += s_warp[w * experts + e];
      }
      const std::int64_t place = static_cast<std::int64_t>(chunk_start[e]) + local;
      const bool keep = capacity < 0 || place < capacity;
      const std::int64_t dest =
          keep ? base[e] + place : kept_total + base[experts + e] + (place - capacity);
      order[dest] = p;
      token[dest] = p / top_k;
      position[p] = keep ? dest : -1;
    }
    __syncthreads();  // every thread has read s_run
    if (leader) {
      atomicAdd(&s_run[e], __popc(peers));
    }
  }
}

using RouteResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

RouteResult moe_route_indices_cuda(const at::Tensor& chosen_arg, int64_t num_experts, int64_t top_k,
                                   int64_t capacity) {
  const int64_t pairs = detail::check_moe_route(chosen_arg, num_experts, top_k);
  TORCH_CHECK(num_experts <= kMaxExperts, "d9d::moe_route_indices: num_experts = ", num_experts,
              "; the CUDA kernel takes at most ", kMaxExperts,
              " (its per-expert counters live in shared memory)");
  const c10::cuda::CUDAGuard guard(chosen_arg.device());
  const at::Tensor chosen = chosen_arg.contiguous();
  const auto options = chosen.options();
  at::Tensor order = at::empty({pairs}, options);
  at::Tensor token = at::empty({pairs}, options);
  at::Tensor position = at::empty({pairs / top_k, top_k}, options);
  if (pairs == 0) {
    return {order, token, position, at::zeros({num_experts}, options),
            at::zeros({num_experts}, options)};
  }
  at::Tensor counts = at::empty({num_experts}, options);
  at::Tensor kept_counts = at::empty({num_experts}, options);
  const auto experts = static_cast<int>(num_experts);
  const auto chunks = static_cast<int>((pairs + kChunk - 1) / kChunk);
  at::Tensor scratch = at::empty({static_cast<int64_t>(chunks) * experts + 2 * num_experts + 1},
                                 options.dtype(at::kInt));
  int* hist = scratch.mutable_data_ptr<int>();
  int* base = hist + static_cast<int64_t>(chunks) * experts;
  const auto stream = at::cuda::getCurrentCUDAStream();

  route_histogram_kernel<<<chunks, kRouteThreads, experts * sizeof(int), stream>>>(
      chosen.const_data_ptr<int64_t>(), pairs, experts, hist);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  route_scan_kernel<<<1, kScanThreads, 0, stream>>>(hist, chunks, experts, capacity,
                                                    counts.mutable_data_ptr<int64_t>(),
                                                    kept_counts.mutable_data_ptr<int64_t>(), base);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const std::size_t place_bytes = static_cast<std::size_t>(1 + kRouteWarps) * experts * sizeof(int);
  if (place_bytes > kDefaultSharedBytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(route_place_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(place_bytes)));
  }
  route_place_kernel<<<chunks, kRouteThreads, place_bytes, stream>>>(
      chosen.const_data_ptr<int64_t>(), pairs, experts, top_k, capacity, hist, base,
      order.mutable_data_ptr<int64_t>(), token.mutable_data_ptr<int64_t>(),
      position.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {order, token, position, counts, kept_counts};
}

// ---- rows --------------------------------------------------------------------------------------

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xFFFFFFFFU, v, offset);
  }
  return v;
}

// rows[i] = x[token[i]]: one block per row.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const T* __restrict__ x, const std::int64_t* __restrict__ token,
                       T* __restrict__ out, std::int64_t tokens, std::int64_t hidden) {
  using V = Vec<T, VEC>;
  const std::int64_t i = blockIdx.x;
  const std::int64_t t = token[i];
  CUDA_KERNEL_ASSERT(t >= 0 && t < tokens);
  if (t < 0 || t >= tokens) {
    return;
  }
  const V* from = reinterpret_cast<const V*>(x + t * hidden);
  V* to = reinterpret_cast<V*>(out + i * hidden);
  for (std::int64_t v = threadIdx.x; v < hidden / VEC; v += blockDim.x) {
    to[v] = from[v];
  }
}

// out[t] = sum over t's kept pairs, in increasing position, of rows[position] (times the pair's
// weight when kWeighted): one block per token. Shared memory: 2 * top_k int64 and 2 * top_k A.
template <typename T, int VEC, bool kWeighted>
__global__ void __launch_bounds__(kRowThreads)
    token_sum_kernel(const T* __restrict__ rows, const T* __restrict__ weights,
                     const std::int64_t* __restrict__ position, T* __restrict__ out,
                     std::int64_t row_count, std::int64_t top_k, std::int64_t hidden) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* raw_position = reinterpret_cast<std::int64_t*>(smem);  // [top_k], the pairs' order
  std::int64_t* sorted_position = raw_position + top_k;        // [top_k], the kept ones, ranked
  auto* raw_weight = reinterpret_cast<A*>(sorted_position + top_k);
  A* sorted_weight = raw_weight + top_k;
  const std::int64_t t = blockIdx.x;
  for (std::int64_t j = threadIdx.x; j < top_k; j += blockDim.x) {
    const std::int64_t i = position[t * top_k + j];
    CUDA_KERNEL_ASSERT(i < row_count);
    raw_position[j] = i < row_count ? i : -1;
    if constexpr (kWeighted) {
      raw_weight[j] = static_cast<A>(weights[t * top_k + j]);
    }
  }
  __syncthreads();
  // Each kept pair's rank among the token's kept positions (distinct) is where it goes.
  for (std::int64_t j = threadIdx.x; j < top_k; j += blockDim.x) {
    const std::int64_t i = raw_position[j];
    if (i < 0) {
      continue;
    }
    std::int64_t rank = 0;
    for (std::int64_t q = 0; q < top_k; ++q) {
      const std::int64_t other = raw_position[q];
      rank += (other >= 0 && other < i) ? 1 : 0;
    }
    sorted_position[rank] = i;
    if constexpr (kWeighted) {
      sorted_weight[rank] = raw_weight[j];
    }
  }
  std::int64_t kept = 0;
  for (std::int64_t q = 0; q < top_k; ++q) {
    kept += raw_position[q] >= 0 ? 1 : 0;
  }
  __syncthreads();
  V* to = reinterpret_cast<V*>(out + t * hidden);
  for (std::int64_t v = threadIdx.x; v < hidden / VEC; v += blockDim.x) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      acc[e] = A(0);
    }
    for (std::int64_t s = 0; s < kept; ++s) {
      const V r = reinterpret_cast<const V*>(rows + sorted_position[s] * hidden)[v];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if constexpr (kWeighted) {
          acc[e] = acc[e] + mul_rn(static_cast<A>(r.val[e]), sorted_weight[s]);
        } else {
          acc[e] = acc[e] + static_cast<A>(r.val[e]);
        }
      }
    }
    V o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      o.val[e] = static_cast<T>(acc[e]);
    }
    to[v] = o;
  }
}

// For pair p kept at row i of token t: d_outputs[i] = dy[t] * w[p], d_weights[p] = dot(dy[t],
// outputs[i]) (a fixed tree over the block); 0 for a dropped pair. One block per pair.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_backward_kernel(const T* __restrict__ dy, const T* __restrict__ outputs,
                              const T* __restrict__ weights,
                              const std::int64_t* __restrict__ position, T* __restrict__ d_outputs,
                              T* __restrict__ d_weights, std::int64_t row_count, std::int64_t top_k,
                              std::int64_t hidden) {
  using A = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  __shared__ A scratch[kRowThreads / kWarp];
  const std::int64_t p = blockIdx.x;
  const std::int64_t i = position[p];
  CUDA_KERNEL_ASSERT(i < row_count);
  if (i < 0 || i >= row_count) {  // the whole block leaves together
    if (threadIdx.x == 0) {
      d_weights[p] = static_cast<T>(0);
    }
    return;
  }
  const std::int64_t t = p / top_k;
  const auto w = static_cast<A>(weights[p]);
  const V* g_row = reinterpret_cast<const V*>(dy + t * hidden);
  const V* o_row = reinterpret_cast<const V*>(outputs + i * hidden);
  V* d_row = reinterpret_cast<V*>(d_outputs + i * hidden);
  A dot = 0;
  for (std::int64_t v = threadIdx.x; v < hidden / VEC; v += blockDim.x) {
    const V g = g_row[v];
    const V o = o_row[v];
    V d;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const auto ge = static_cast<A>(g.val[e]);
      d.val[e] = static_cast<T>(mul_rn(ge, w));
      dot += ge * static_cast<A>(o.val[e]);
    }
    d_row[v] = d;
  }
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  dot = warp_sum(dot);
  if (lane == 0) {
    scratch[warp] = dot;
  }
  __syncthreads();
  if (warp == 0) {
    A total = lane < kRowThreads / kWarp ? scratch[lane] : A(0);
    total = warp_sum(total);
    if (lane == 0) {
      d_weights[p] = static_cast<T>(total);
    }
  }
}

// One block per row: at most 2^31 - 1 of them (gridDim.x).
unsigned grid(std::int64_t blocks) {
  TORCH_CHECK(blocks < (std::int64_t{1} << 31), "d9d::moe_permute / moe_unpermute: ", blocks,
              " rows; at most 2^31 - 1 are supported");
  return static_cast<unsigned>(blocks);
}

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether rows of `hidden` elements of T starting at each pointer move as 16-byte vectors.
template <typename T>
bool vectorised(std::int64_t hidden, std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
  if (hidden % kVec != 0) {
    return false;
  }
  return std::all_of(pointers.begin(), pointers.end(), [](const void* p) { return aligned(p); });
}

at::Tensor moe_permute_forward_cuda(const at::Tensor& x_arg, const at::Tensor& token_arg) {
  detail::check_moe_indices("moe_permute_forward", x_arg, token_arg, at::Tensor(), -1);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor token = token_arg.contiguous();
  const int64_t rows = token.numel();
  const int64_t hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  if (rows == 0 || hidden == 0) {
    return out;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "d9d::moe_permute_forward_cuda", [&] {
        constexpr int kVec = 16 / sizeof(scalar_t);
        const auto* from = x.const_data_ptr<scalar_t>();
        auto* to = out.mutable_data_ptr<scalar_t>();
        const int64_t* index = token.const_data_ptr<int64_t>();
        if (vectorised<scalar_t>(hidden, {from, to})) {
          gather_rows_kernel<scalar_t, kVec>
              <<<grid(rows), kRowThreads, 0, stream>>>(from, index, to, x.size(0), hidden);
        } else {
          gather_rows_kernel<scalar_t, 1>
              <<<grid(rows), kRowThreads, 0, stream>>>(from, index, to, x.size(0), hidden);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

// Shared memory of token_sum_kernel for `top_k` pairs per token.
template <typename T>
std::size_t token_sum_bytes(std::int64_t top_k) {
  return static_cast<std::size_t>(top_k) * 2 * (sizeof(std::int64_t) + sizeof(at::opmath_type<T>));
}

template <typename T, bool kWeighted>
void launch_token_sum(const T* rows, const T* weights, const std::int64_t* position, T* out,
                      std::int64_t row_count, std::int64_t tokens, std::int64_t top_k,
                      std::int64_t hidden) {
  constexpr int kVec = 16 / sizeof(T);
  const std::size_t bytes = token_sum_bytes<T>(top_k);
  TORCH_CHECK(bytes <= kDefaultSharedBytes, "d9d::moe_permute / moe_unpermute: top_k = ", top_k,
              " is too large for the CUDA kernel (at most ",
              kDefaultSharedBytes / token_sum_bytes<T>(1), ")");
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (vectorised<T>(hidden, {rows, out})) {
    token_sum_kernel<T, kVec, kWeighted><<<grid(tokens), kRowThreads, bytes, stream>>>(
        rows, weights, position, out, row_count, top_k, hidden);
  } else {
    token_sum_kernel<T, 1, kWeighted><<<grid(tokens), kRowThreads, bytes, stream>>>(
        rows, weights, position, out, row_count, top_k, hidden);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor moe_permute_backward_cuda(const at::Tensor& grad_arg, const at::Tensor& position_arg) {
  detail::check_moe_indices("moe_permute_backward", grad_arg, at::Tensor(), position_arg, -1);
  const c10::cuda::CUDAGuard guard(grad_arg.device());
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor position = position_arg.contiguous();
  const int64_t tokens = position.size(0);
  const int64_t hidden = grad.size(1);
  at::Tensor out = at::empty({tokens, hidden}, grad.options());
  if (tokens == 0 || hidden == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, grad.scalar_type(), "d9d::moe_permute_backward_cuda", [&] {
        launch_token_sum<scalar_t, false>(
            grad.const_data_ptr<scalar_t>(), nullptr, position.const_data_ptr<int64_t>(),
            out.mutable_data_ptr<scalar_t>(), grad.size(0), tokens, position.size(1), hidden);
      });
  return out;
}

at::Tensor moe_unpermute_forward_cuda(const at::Tensor& outputs_arg, const at::Tensor& weights_arg,
                                      const at::Tensor& position_arg) {
  detail::check_moe_unpermute(outputs_arg, weights_arg, position_arg, at::Tensor());
  const c10::cuda::CUDAGuard guard(outputs_arg.device());
  const at::Tensor outputs = outputs_arg.contiguous();
  const at::Tensor weights = weights_arg.contiguous();
  const at::Tensor position = position_arg.contiguous();
  const int64_t tokens = position.size(0);
  const int64_t hidden = outputs.size(1);
  at::Tensor out = at::empty({tokens, hidden}, outputs.options());
  if (tokens == 0 || hidden == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, outputs.scalar_type(), "d9d::moe_unpermute_forward_cuda", [&] {
        launch_token_sum<scalar_t, true>(
            outputs.const_data_ptr<scalar_t>(), weights.const_data_ptr<scalar_t>(),
            position.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), outputs.size(0),
            tokens, position.size(1), hidden);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_cuda(const at::Tensor& grad_arg,
                                                               const at::Tensor& outputs_arg,
                                                               const at::Tensor& weights_arg,
                                                               const at::Tensor& position_arg) {
  detail::check_moe_unpermute(outputs_arg, weights_arg, position_arg, grad_arg);
  const c10::cuda::CUDAGuard guard(outputs_arg.device());
  const at::Tensor grad = grad_arg.contiguous();
  const at::Tensor outputs = outputs_arg.contiguous();
  const at::Tensor weights = weights_arg.contiguous();
  const at::Tensor position = position_arg.contiguous();
  at::Tensor grad_outputs = at::empty_like(outputs);
  at::Tensor grad_weights = at::empty_like(weights);
  const int64_t pairs = position.numel();
  const int64_t hidden = outputs.size(1);
  if (pairs == 0) {
    return {grad_outputs, grad_weights};
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, outputs.scalar_type(), "d9d::moe_unpermute_backward_cuda", [&] {
        constexpr int kVec = 16 / sizeof(scalar_t);
        const auto* dy = grad.const_data_ptr<scalar_t>();
        const auto* o = outputs.const_data_ptr<scalar_t>();
        const auto* w = weights.const_data_ptr<scalar_t>();
        const int64_t* pos = position.const_data_ptr<int64_t>();
        auto* d_o = grad_outputs.mutable_data_ptr<scalar_t>();
        auto* d_w = grad_weights.mutable_data_ptr<scalar_t>();
        if (vectorised<scalar_t>(hidden, {dy, o, d_o})) {
          unpermute_backward_kernel<scalar_t, kVec><<<grid(pairs), kRowThreads, 0, stream>>>(
              dy, o, w, pos, d_o, d_w, outputs.size(0), position.size(1), hidden);
        } else {
          unpermute_backward_kernel<scalar_t, 1><<<grid(pairs), kRowThreads, 0, stream>>>(
              dy, o, w, pos, d_o, d_w, outputs.size(0), position.size(1), hidden);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {grad_outputs, grad_weights};
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("moe_route_indices", &d9d::kernels::moe_route_indices_cuda);
  m.impl("moe_permute_forward", &d9d::kernels::moe_permute_forward_cuda);
  m.impl("moe_permute_backward", &d9d::kernels::moe_permute_backward_cuda);
  m.impl("moe_unpermute_forward", &d9d::kernels::moe_unpermute_forward_cuda);
  m.impl("moe_unpermute_backward", &d9d::kernels::moe_unpermute_backward_cuda);
}
