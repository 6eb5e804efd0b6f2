// d9d/kernels/scale.cu — CUDA kernel of d9d::scale_ (src/kernels/scale.cpp: the schema, the
// checks and the CPU reference).
//
// bfloat16 lists: one launch for the whole list. The host sends a table (per tensor: its pointer,
// size and first block) from pinned memory; block b finds its tensor by binary search over the
// first blocks and scales kSpan elements of it, 8 per thread and step with 16-byte loads when
// every pointer is 16-byte aligned. Each element: float32 product with the float32 scale read on
// the device, rounded to nearest even once (bit-identical to the CPU kernel, NaN payloads aside).
// Memory bound: 4 bytes per element (read and write 2). Other dtypes: at::_foreach_mul_ with the
// scale in the list's dtype (its fast route). Under CUDA graph capture: the definition, tensor by
// tensor.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <d9d/kernels/scale.hpp>

namespace d9d::kernels {
namespace {

using Bits = std::uint16_t;  // bfloat16 storage

constexpr int kThreads = 256;
constexpr std::int64_t kSpan = 4096;  // elements per block: two 8-element steps per thread
constexpr int kSlotWords = 3;         // pointer, numel, first block

struct Slot {
  Bits* x;
  std::int64_t n;
  std::int64_t first;
};
static_assert(sizeof(Slot) == kSlotWords * sizeof(std::int64_t));

__device__ __forceinline__ float to_float(Bits b) {
  return __uint_as_float(static_cast<std::uint32_t>(b) << 16);
}

// Round to nearest even, as c10::BFloat16's conversion (NaN stays a quiet NaN).
__device__ __forceinline__ std::uint32_t to_bits(float f) {
  const std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) {
    return 0x7FC0U;
  }
  return (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
}

__device__ __forceinline__ std::uint32_t scale_pair(std::uint32_t pair, float s) {
  const float lo = to_float(static_cast<Bits>(pair & 0xFFFFU)) * s;
  const float hi = to_float(static_cast<Bits>(pair >> 16)) * s;
  return to_bits(lo) | (to_bits(hi) << 16);
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    scale_bf16_kernel(const Slot* __restrict__ slots, std::int64_t count,
                      const float* __restrict__ scale) {
  const auto block = static_cast<std::int64_t>(blockIdx.x);
  // The last tensor whose first block is at or before this one (empty tensors are not listed).
  std::int64_t lo = 0;
  std::int64_t hi = count - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (slots[mid].first <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const Slot slot = slots[lo];
  const std::int64_t start = (block - slot.first) * kSpan;
  const std::int64_t end = std::min(start + kSpan, slot.n);
  const float s = *scale;
  std::int64_t tail = start;
  if constexpr (kVec) {
    // start is a multiple of kSpan and the base 16-byte aligned: every 8-element step is too.
    const std::int64_t body = start + (end - start) / 8 * 8;
    for (std::int64_t i = start + 8 * static_cast<std::int64_t>(threadIdx.x); i < body;
         i += 8 * kThreads) {
      auto* p = reinterpret_cast<uint4*>(slot.x + i);
      uint4 v = *p;
      v.x = scale_pair(v.x, s);
      v.y = scale_pair(v.y, s);
      v.z = scale_pair(v.z, s);
      v.w = scale_pair(v.w, s);
      *p = v;
    }
    tail = body;
  }
  for (std::int64_t i = tail + threadIdx.x; i < end; i += kThreads) {
    slot.x[i] = static_cast<Bits>(to_bits(to_float(slot.x[i]) * s));
  }
}

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

void scale_cuda(at::TensorList tensors, const at::Tensor& scale) {
  detail::check_scale(tensors, scale);
  if (tensors.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const auto dtype = tensors[0].scalar_type();
  if (dtype != at::kBFloat16) {
    at::_foreach_mul_(tensors, scale.reshape({}).to(dtype));
    return;
  }
  // Non-contiguous tensors (rare for gradients) by the definition, one at a time; under CUDA graph
  // capture every tensor goes that way (a capture would record the table's copy from host memory
  // that the next call reuses).
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  const at::Tensor factor = scale.reshape({}).to(at::kFloat).contiguous();
  std::vector<const at::Tensor*> listed;
  std::int64_t blocks = 0;
  bool vectorised = true;
  for (const auto& t : tensors) {
    if (!t.is_contiguous() || capturing != cudaStreamCaptureStatusNone) {
      detail::scale_by_definition(t, factor);
    } else if (t.numel() > 0) {
      listed.push_back(&t);
      blocks += (t.numel() + kSpan - 1) / kSpan;
      vectorised = vectorised && aligned(t.const_data_ptr());
    }
  }
  if (listed.empty()) {
    return;
  }
  const auto count = static_cast<std::int64_t>(listed.size());
  at::Tensor host =
      at::empty({count * kSlotWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* slots = reinterpret_cast<Slot*>(host.mutable_data_ptr<std::int64_t>());
  std::int64_t first = 0;
  for (std::int64_t t = 0; t < count; ++t) {
    const auto& tensor = *listed[static_cast<std::size_t>(t)];
    slots[t] =
        Slot{.x = static_cast<Bits*>(tensor.data_ptr()), .n = tensor.numel(), .first = first};
    first += (tensor.numel() + kSpan - 1) / kSpan;
  }
  const at::Tensor table = host.to(tensors[0].device(), /*non_blocking=*/true);
  const auto* device_slots = reinterpret_cast<const Slot*>(table.const_data_ptr<std::int64_t>());
  if (vectorised) {
    scale_bf16_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        device_slots, count, factor.const_data_ptr<float>());
  } else {
    scale_bf16_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        device_slots, count, factor.const_data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) { m.impl("scale_", &d9d::kernels::scale_cuda); }
