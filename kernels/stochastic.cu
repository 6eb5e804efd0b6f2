// d9d/kernels/stochastic.cu — CUDA kernels of d9d::adamw_stochastic_ and d9d::copy_stochastic_.
//
// adamw_stochastic_ is one launch for the whole list: the host cuts every tensor into chunks of
// kChunk elements and sends a table (per tensor: its pointers, size and list index; per chunk: its
// tensor and first element) with the launch; each chunk is updated by kChunk / span blocks of
// `span` elements each, four elements per thread and step with 8- or 16-byte loads when every
// pointer is 16-byte aligned. With float32 moments the blocks are short (256 threads, 2048
// elements: two steps per thread, both steps' loads issued before any arithmetic, 88.8% -> 89.6%
// of an H100's 3.35 TB/s in bench/bandwidth_variants.cu): on an H200 the one-tensor update
// took 3.43 ms instead of 3.48-3.52 with one 512-thread block looping over the whole 65,536-element
// chunk (1,024 or 512 elements per block: 3.57-3.61 ms; bench/kernels_bench, and
// bench/bandwidth_variants.cu outside LibTorch). With bfloat16 moments the update costs more
// arithmetic per byte and the long blocks stay ahead (2.76 ms against 3.06 with 1,024 per block).
// Per element it reads the parameter, the gradient and both moments and writes the parameter and
// the moments: memory bound (22 bytes per element with bfloat16 gradients and float32 moments).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <d9d/kernels/detail/stochastic_rounding.hpp>
#include <d9d/kernels/stochastic.hpp>

namespace d9d::kernels {
namespace {

constexpr int kThreads = 512;  // copy_stochastic_ and the long AdamW blocks
constexpr std::int64_t kChunk = 65536;
constexpr int kSlotWords = 6;  // p, g, m, v, numel, list index

using Bits = std::uint16_t;  // bfloat16 storage

__device__ __forceinline__ float load1(const float* base, std::int64_t i) { return base[i]; }
__device__ __forceinline__ float load1(const Bits* base, std::int64_t i) {
  return detail::bf16_bits_to_float(base[i]);
}
__device__ __forceinline__ void load4(const float* base, std::int64_t i, float (&out)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(base + i);
  out[0] = x.x;
  out[1] = x.y;
  out[2] = x.z;
  out[3] = x.w;
}
__device__ __forceinline__ void load4(const Bits* base, std::int64_t i, float (&out)[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(base + i);
  out[0] = detail::bf16_bits_to_float(static_cast<Bits>(x.x & 0xFFFFU));
  out[1] = detail::bf16_bits_to_float(static_cast<Bits>(x.x >> 16));
  out[2] = detail::bf16_bits_to_float(static_cast<Bits>(x.y & 0xFFFFU));
  out[3] = detail::bf16_bits_to_float(static_cast<Bits>(x.y >> 16));
}
__device__ __forceinline__ void store1(float* base, std::int64_t i, float value, std::uint32_t) {
  base[i] = value;
}
__device__ __forceinline__ void store1(Bits* base, std::int64_t i, float value, std::uint32_t r) {
  base[i] = detail::stochastic_bf16_bits(value, r);
}
__device__ __forceinline__ void store4(float* base, std::int64_t i, const float (&value)[4],
                                       const std::uint32_t (&)[4]) {
  *reinterpret_cast<float4*>(base + i) = make_float4(value[0], value[1], value[2], value[3]);
}
__device__ __forceinline__ void store4(Bits* base, std::int64_t i, const float (&value)[4],
                                       const std::uint32_t (&r)[4]) {
  uint2 x;
  x.x = detail::stochastic_bf16_bits(value[0], r[0]) |
        (static_cast<std::uint32_t>(detail::stochastic_bf16_bits(value[1], r[1])) << 16);
  x.y = detail::stochastic_bf16_bits(value[2], r[2]) |
        (static_cast<std::uint32_t>(detail::stochastic_bf16_bits(value[3], r[3])) << 16);
  *reinterpret_cast<uint2*>(base + i) = x;
}

struct Slot {
  Bits* p;
  const void* g;
  void* m;
  void* v;
  std::int64_t n;
  std::int64_t index;
};
static_assert(sizeof(Slot) == kSlotWords * sizeof(std::int64_t));

// The launch shape of one (moment type): threads per block, elements per block (a divisor of
// kChunk), and the steps per thread whose loads a whole span issues first (1: a plain loop).
template <typename S>
struct AdamWShape {
  static constexpr int threads = 256;
  static constexpr std::int64_t span = 2048;
  static constexpr int unroll = 2;  // 54 registers: 4 blocks of 256 per SM, 2 steps in flight each
};
template <>
struct AdamWShape<Bits> {
  static constexpr int threads = kThreads;
  static constexpr std::int64_t span = kChunk;
  static constexpr int unroll = 1;
};

// (No __launch_bounds__: with it the bfloat16-moment kernel ran 3.7 ms instead of 2.8 ms.)
template <typename G, typename S, bool kVec>
__global__ void adamw_stochastic_kernel(const Slot* __restrict__ slots,
                                        const std::int64_t* __restrict__ chunks,
                                        detail::AdamWScalars s, std::uint64_t seed) {
  constexpr std::int64_t kSpan = AdamWShape<S>::span;
  constexpr std::int64_t kPerChunk = kChunk / kSpan;
  static_assert(kChunk % kSpan == 0);
  const std::int64_t chunk = blockIdx.x / kPerChunk;
  const Slot slot = slots[chunks[2 * chunk]];
  const std::int64_t start = chunks[2 * chunk + 1] + (blockIdx.x % kPerChunk) * kSpan;
  const std::int64_t end = std::min(start + kSpan, slot.n);  // start >= end: the block is idle
  const auto* g = static_cast<const G*>(slot.g);
  auto* m = static_cast<S*>(slot.m);
  auto* v = static_cast<S*>(slot.v);
  const auto tensor = static_cast<std::uint64_t>(slot.index);
  const auto one = [&](std::int64_t i) {
    const std::uint64_t r = detail::random_bits(seed, tensor, static_cast<std::uint64_t>(i));
    float mv = load1(m, i);
    float vv = load1(v, i);
    const float p =
        detail::adamw_element(detail::bf16_bits_to_float(slot.p[i]), load1(g, i), mv, vv, s);
    slot.p[i] = detail::stochastic_bf16_bits(p, static_cast<std::uint32_t>(r));
    store1(m, i, mv, static_cast<std::uint32_t>(r >> 16));
    store1(v, i, vv, static_cast<std::uint32_t>(r >> 32));
  };
  // Four elements of one thread and step: the loads, then the update and the stores.
  struct Group {
    float p[4];
    float g[4];
    float m[4];
    float v[4];
  };
  const auto fetch = [&](std::int64_t i, Group& x) {
    load4(slot.p, i, x.p);
    load4(g, i, x.g);
    load4(m, i, x.m);
    load4(v, i, x.v);
  };
  const auto update = [&](std::int64_t i, Group& x) {
    std::uint32_t rp[4];
    std::uint32_t rm[4];
    std::uint32_t rv[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t r = detail::random_bits(seed, tensor, static_cast<std::uint64_t>(i + k));
      rp[k] = static_cast<std::uint32_t>(r);
      rm[k] = static_cast<std::uint32_t>(r >> 16);
      rv[k] = static_cast<std::uint32_t>(r >> 32);
      x.p[k] = detail::adamw_element(x.p[k], x.g[k], x.m[k], x.v[k], s);
    }
    store4(slot.p, i, x.p, rp);
    store4(m, i, x.m, rm);
    store4(v, i, x.v, rv);
  };
  constexpr int kUnroll = AdamWShape<S>::unroll;
  if constexpr (kVec && kUnroll > 1) {
    // A whole span: each thread issues the loads of its kUnroll steps before any arithmetic, so it
    // has kUnroll times the bytes in flight (the stores cannot overtake loads of other elements).
    if (end - start == kSpan) {
      constexpr std::int64_t kStep = 4 * std::int64_t{AdamWShape<S>::threads};
      static_assert(kSpan == kStep * kUnroll);
      const std::int64_t first = start + 4 * static_cast<std::int64_t>(threadIdx.x);
      Group x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        fetch(first + u * kStep, x[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        update(first + u * kStep, x[u]);
      }
      return;
    }
  }
  if constexpr (kVec) {
    for (std::int64_t i = start + 4 * static_cast<std::int64_t>(threadIdx.x); i < end;
         i += 4 * static_cast<std::int64_t>(blockDim.x)) {
      if (i + 4 > end) {
        for (std::int64_t k = i; k < end; ++k) {
          one(k);
        }
        continue;
      }
      Group x;
      fetch(i, x);
      update(i, x);
    }
  } else {
    for (std::int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      one(i);
    }
  }
}

template <bool kVec>
__global__ void copy_stochastic_kernel(Bits* __restrict__ dst, const float* __restrict__ src,
                                       std::int64_t n, std::uint64_t seed) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  std::int64_t done = 0;
  if constexpr (kVec) {  // four elements per thread and step: a 16-byte load, an 8-byte store
    const std::int64_t groups = n / 4;
    for (std::int64_t q = first; q < groups; q += stride) {
      float x[4];
      load4(src, 4 * q, x);
      std::uint32_t r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        r[k] = static_cast<std::uint32_t>(
            detail::random_bits(seed, 0, static_cast<std::uint64_t>(4 * q + k)));
      }
      store4(dst, 4 * q, x, r);
    }
    done = groups * 4;
  }
  for (std::int64_t i = done + first; i < n; i += stride) {
    const std::uint64_t r = detail::random_bits(seed, 0, static_cast<std::uint64_t>(i));
    dst[i] = detail::stochastic_bf16_bits(src[i], static_cast<std::uint32_t>(r));
  }
}

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <typename G, typename S>
void launch(bool vectorised, std::int64_t chunks_count, const Slot* slots,
            const std::int64_t* chunks, const detail::AdamWScalars& s, std::uint64_t seed,
            cudaStream_t stream) {
  using Shape = AdamWShape<S>;
  const auto blocks = static_cast<unsigned>(chunks_count * (kChunk / Shape::span));
  if (vectorised) {
    adamw_stochastic_kernel<G, S, true>
        <<<blocks, Shape::threads, 0, stream>>>(slots, chunks, s, seed);
  } else {
    adamw_stochastic_kernel<G, S, false>
        <<<blocks, Shape::threads, 0, stream>>>(slots, chunks, s, seed);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adamw_stochastic_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                           double eps, double weight_decay, std::int64_t step, std::int64_t seed) {
  detail::check_adamw_stochastic(params, grads, exp_avgs, exp_avg_sqs);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  // The table: slots, then (slot, start) per chunk; sent with the launch from pinned memory.
  std::vector<std::int64_t> chunks;
  bool vectorised = true;
  for (size_t t = 0; t < params.size(); ++t) {
    for (std::int64_t start = 0; start < params[t].numel(); start += kChunk) {
      chunks.push_back(static_cast<std::int64_t>(t));
      chunks.push_back(start);
    }
    vectorised = vectorised && aligned(params[t].const_data_ptr()) &&
                 aligned(grads[t].const_data_ptr()) && aligned(exp_avgs[t].const_data_ptr()) &&
                 aligned(exp_avg_sqs[t].const_data_ptr());
  }
  const auto blocks = static_cast<std::int64_t>(chunks.size() / 2);
  if (blocks == 0) {
    return;
  }
  const auto slot_words = static_cast<std::int64_t>(params.size()) * kSlotWords;
  at::Tensor host = at::empty({slot_words + static_cast<std::int64_t>(chunks.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* slots = reinterpret_cast<Slot*>(host.mutable_data_ptr<std::int64_t>());
  for (size_t t = 0; t < params.size(); ++t) {
    slots[t] = Slot{.p = static_cast<Bits*>(params[t].data_ptr()),
                    .g = grads[t].const_data_ptr(),
                    .m = exp_avgs[t].data_ptr(),
                    .v = exp_avg_sqs[t].data_ptr(),
                    .n = params[t].numel(),
                    .index = static_cast<std::int64_t>(t)};
  }
  std::copy(chunks.begin(), chunks.end(), host.mutable_data_ptr<std::int64_t>() + slot_words);
  const at::Tensor table = host.to(params[0].device(), /*non_blocking=*/true);
  const auto* device_slots = reinterpret_cast<const Slot*>(table.const_data_ptr<std::int64_t>());
  const std::int64_t* device_chunks = table.const_data_ptr<std::int64_t>() + slot_words;
  const auto s = detail::make_adamw_scalars(lr, beta1, beta2, eps, weight_decay, step);
  const auto seed_bits = static_cast<std::uint64_t>(seed);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool g16 = grads[0].scalar_type() == at::kBFloat16;
  const bool s16 = exp_avgs[0].scalar_type() == at::kBFloat16;
  if (g16 && s16) {
    launch<Bits, Bits>(vectorised, blocks, device_slots, device_chunks, s, seed_bits, stream);
  } else if (g16) {
    launch<Bits, float>(vectorised, blocks, device_slots, device_chunks, s, seed_bits, stream);
  } else if (s16) {
    launch<float, Bits>(vectorised, blocks, device_slots, device_chunks, s, seed_bits, stream);
  } else {
    launch<float, float>(vectorised, blocks, device_slots, device_chunks, s, seed_bits, stream);
  }
}

void copy_stochastic_cuda(const at::Tensor& dst, const at::Tensor& src_arg, std::int64_t seed) {
  detail::check_copy_stochastic(dst, src_arg);
  const c10::cuda::CUDAGuard guard(dst.device());
  const at::Tensor src = src_arg.contiguous();
  const std::int64_t n = src.numel();
  if (n == 0) {
    return;
  }
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = std::max<std::int64_t>(
      1, std::min<std::int64_t>((n + kThreads - 1) / kThreads, std::int64_t{sms} * 16));
  auto* out = static_cast<Bits*>(dst.data_ptr());
  const float* in = src.const_data_ptr<float>();
  const auto bits = static_cast<std::uint64_t>(seed);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (aligned(out) && aligned(in)) {
    copy_stochastic_kernel<true>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, in, n, bits);
  } else {
    copy_stochastic_kernel<false>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, in, n, bits);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("adamw_stochastic_", &d9d::kernels::adamw_stochastic_cuda);
  m.impl("copy_stochastic_", &d9d::kernels::copy_stochastic_cuda);
}
