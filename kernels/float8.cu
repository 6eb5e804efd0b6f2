// d9d/kernels/float8.cu — CUDA kernels of d9d::float8_quantize (the definition is in
// d9d/kernels/float8.hpp; these reproduce the CPU reference bit for bit: the same float32
// products by power-of-two scales, IEEE division for the scale, round-to-nearest-even casts).
//
// Three kernels:
//   - rows: one block per row of x, the row's largest magnitude reduced in the block, then the
//     row cast — one launch for a per-row quantisation without transpose (activations, weights);
//   - amax: the largest magnitude per column (a 32-column tile per block, a slab of rows each,
//     atomicMax on the float's bits, which order like the non-negative floats and put NaN above
//     infinity) or of the whole tensor;
//   - cast: elementwise by the groups' scales, or transposed through a 32 x 32 shared-memory tile
//     so that both the reads of x and the writes of x^T are coalesced.
// Per-column and per-tensor quantisations are amax then cast (plus the zeroing of the maxima).
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <d9d/kernels/float8.hpp>

namespace d9d::kernels {
namespace {

constexpr int kTile = 32;
constexpr int kTileRows = 8;      // threads per tile column: a tile is 32 x 32 in 32 x 8 threads
constexpr int kAmaxSlab = 256;    // rows of x per amax block
constexpr int kRowThreads = 256;  // threads of a rows-kernel block

// NaN wins; otherwise the larger (the CPU reference's rule).
__device__ __forceinline__ float nan_max(float m, float a) {
  return ((isnan(a) || a > m) && !isnan(m)) ? a : m;
}

// s = 2^floor(log2(M / max(a, 1e-12))); NaN for a group with a NaN or infinite value.
__device__ __forceinline__ float group_scale(float amax, float format_max) {
  const float a = amax < 1e-12F ? 1e-12F : amax;
  const float s = format_max / a;
  if (!(s > 0.0F)) {
    return __int_as_float(0x7FC00000);
  }
  return __uint_as_float(__float_as_uint(s) & 0xFF800000U);
}

template <bool E4M3>
__device__ __forceinline__ std::uint8_t cast(float v, float s, float format_max) {
  float y = v * s;
  y = y > format_max ? format_max : (y < -format_max ? -format_max : y);  // NaN stays NaN
  return static_cast<std::uint8_t>(
      __nv_cvt_float_to_fp8(y, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2));
}

// x[i] as float32, times its dequantisation scale when x is float8.
template <typename T>
struct Reader {
  const T* x;
  const float* scale;  // null unless x is float8
  bool scale_per_row;
  std::int64_t cols;
  __device__ __forceinline__ float operator()(std::int64_t r, std::int64_t c) const {
    const float v = static_cast<float>(x[r * cols + c]);
    return scale == nullptr ? v : v * scale[scale_per_row ? r : 0];
  }
};

template <typename T, bool E4M3>
__global__ void quantize_rows_kernel(Reader<T> read, std::uint8_t* __restrict__ q,
                                     float* __restrict__ inverse, std::int64_t cols,
                                     float format_max) {
  __shared__ float partial[kRowThreads / 32];
  const std::int64_t r = blockIdx.x;
  float m = 0.0F;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    m = nan_max(m, fabsf(read(r, c)));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
  }
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = m;
  }
  __syncthreads();
  m = partial[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
    m = nan_max(m, partial[w]);
  }
  const float s = group_scale(m, format_max);
  if (threadIdx.x == 0) {
    inverse[r] = 1.0F / s;
  }
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    q[r * cols + c] = cast<E4M3>(read(r, c), s, format_max);
  }
}

// The largest magnitude of each column (per_column) or of the tensor, as float bits, into `amax`
// (zeroed before).
template <typename T>
__global__ void amax_kernel(Reader<T> read, std::int64_t rows, std::int64_t cols, bool per_column,
                            unsigned int* __restrict__ amax) {
  __shared__ float partial[kTileRows][kTile];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kTile + threadIdx.x;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kAmaxSlab;
  const std::int64_t r1 = r0 + kAmaxSlab < rows ? r0 + kAmaxSlab : rows;
  float m = 0.0F;
  if (c < cols) {
    for (std::int64_t r = r0 + threadIdx.y; r < r1; r += kTileRows) {
      m = nan_max(m, fabsf(read(r, c)));
    }
  }
  partial[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y != 0) {
    return;
  }
  for (int y = 1; y < kTileRows; ++y) {
    m = nan_max(m, partial[y][threadIdx.x]);
  }
  if (per_column) {
    if (c < cols) {
      atomicMax(amax + c, __float_as_uint(m));
    }
    return;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
  }
  if (threadIdx.x == 0) {
    atomicMax(amax, __float_as_uint(m));
  }
}

// q = x (or x^T with `transpose`) cast by the groups' scales: per output row (`rowwise`, the
// maxima per column of x when transposed) or one for the tensor.
template <typename T, bool E4M3>
__global__ void cast_kernel(Reader<T> read, std::int64_t rows, std::int64_t cols, bool transpose,
                            bool rowwise, const unsigned int* __restrict__ amax,
                            std::uint8_t* __restrict__ q, float* __restrict__ inverse,
                            float format_max) {
  __shared__ float tile[kTile][kTile + 1];
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const float whole = rowwise ? 0.0F : group_scale(__uint_as_float(amax[0]), format_max);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    inverse[0] = 1.0F / whole;
  }
  if (!transpose) {
    // Per tensor only (per-row scales without transpose take quantize_rows_kernel).
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const std::int64_t r = r0 + i;
      const std::int64_t c = c0 + threadIdx.x;
      if (r < rows && c < cols) {
        q[r * cols + c] = cast<E4M3>(read(r, c), whole, format_max);
      }
    }
    return;
  }
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const std::int64_t r = r0 + i;
    const std::int64_t c = c0 + threadIdx.x;
    tile[i][threadIdx.x] = (r < rows && c < cols) ? read(r, c) : 0.0F;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const std::int64_t out_row = c0 + i;            // a column of x
    const std::int64_t out_col = r0 + threadIdx.x;  // a row of x
    if (out_row >= cols) {
      continue;
    }
    const float s = rowwise ? group_scale(__uint_as_float(amax[out_row]), format_max) : whole;
    if (rowwise && blockIdx.y == 0 && threadIdx.x == 0) {
      inverse[out_row] = 1.0F / s;
    }
    if (out_col < rows) {
      q[out_row * rows + out_col] = cast<E4M3>(tile[threadIdx.x][i], s, format_max);
    }
  }
}

template <typename F>
void dispatch_input(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float());
    case at::kDouble:
      return f(double());
    case at::kBFloat16:
      return f(c10::BFloat16());
    case at::kHalf:
      return f(c10::Half());
    case at::kFloat8_e4m3fn:
      return f(c10::Float8_e4m3fn());
    case at::kFloat8_e5m2:
      return f(c10::Float8_e5m2());
    default:
      TORCH_CHECK(false, "d9d::float8_quantize: unsupported input ", type);
  }
}

std::tuple<at::Tensor, at::Tensor> float8_quantize_cuda(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& x_scale_arg, at::ScalarType format,
    bool rowwise, bool transpose) {
  const at::Tensor x_scale_in = x_scale_arg.value_or(at::Tensor());
  detail::check_float8_quantize(x_arg, x_scale_in, format);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor x_scale = x_scale_in.defined() ? x_scale_in.contiguous() : x_scale_in;
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  const float format_max = float8_max(format);
  const bool e4m3 = format == at::kFloat8_e4m3fn;
  const std::int64_t groups = rowwise ? (transpose ? cols : rows) : 1;
  auto inverse = rowwise ? at::empty({groups, 1}, x.options().dtype(at::kFloat))
                         : at::empty({}, x.options().dtype(at::kFloat));
  auto q = transpose ? at::empty({cols, rows}, x.options().dtype(format))
                     : at::empty({rows, cols}, x.options().dtype(format));
  if (rows == 0 || cols == 0) {
    if (groups > 0) {
      inverse.fill_(1.0);
    }
    return {q, inverse};
  }
  TORCH_CHECK((rowwise && !transpose) || (rows + kTile - 1) / kTile <= 65535,
              "d9d::float8_quantize: x ", x.sizes(), " has more rows than the CUDA kernels take");
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* out = static_cast<std::uint8_t*>(q.mutable_data_ptr());
  float* inv = inverse.mutable_data_ptr<float>();
  const float* scale = x_scale.defined() ? x_scale.const_data_ptr<float>() : nullptr;
  const bool scale_per_row = x_scale.defined() && x_scale.dim() == 2;
  dispatch_input(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const Reader<T> read{static_cast<const T*>(x.const_data_ptr()), scale, scale_per_row, cols};
    const auto launch = [&](auto e4m3_tag) {
      constexpr bool kE4M3 = decltype(e4m3_tag)::value;
      if (rowwise && !transpose) {
        quantize_rows_kernel<T, kE4M3><<<static_cast<unsigned int>(rows), kRowThreads, 0, stream>>>(
            read, out, inv, cols, format_max);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      auto amax = at::zeros({groups}, x.options().dtype(at::kInt));
      auto* bits = reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<int>());
      const dim3 threads(kTile, kTileRows);
      const dim3 amax_grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                           static_cast<unsigned int>((rows + kAmaxSlab - 1) / kAmaxSlab));
      amax_kernel<T><<<amax_grid, threads, 0, stream>>>(read, rows, cols, rowwise, bits);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const dim3 cast_grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                           static_cast<unsigned int>((rows + kTile - 1) / kTile));
      cast_kernel<T, kE4M3><<<cast_grid, threads, 0, stream>>>(read, rows, cols, transpose, rowwise,
                                                               bits, out, inv, format_max);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (e4m3) {
      launch(std::true_type());
    } else {
      launch(std::false_type());
    }
  });
  return {q, inverse};
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) { m.impl("float8_quantize", &d9d::kernels::float8_quantize_cuda); }
