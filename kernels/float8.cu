// d9d/kernels/float8.cu — CUDA kernels of d9d::float8_quantize (the definition is in
// d9d/kernels/float8.hpp; these reproduce the CPU reference bit for bit: the same float32
// products by power-of-two scales, IEEE division for the scale, round-to-nearest-even casts).
//
// Fast paths (float32, bfloat16 and float16 x with 16-byte aligned rows), 16-byte loads:
//   - fast_rows: 32 rows per block, a warp per row for its largest magnitude, then every thread
//     casting column vectors down the block's rows (8-byte stores for 2-byte inputs), optionally
//     taking the columns' largest magnitudes on the way (atomicMax per block and column, on the
//     float's bits, which order like the non-negative floats and put NaN above infinity): the
//     rows of float8_quantize_both and the columns' maxima in one pass over x;
//   - fast_amax: the largest magnitude of the tensor (grid-stride, one atomicMax per block);
//   - fast_tile: a 64 x 64 tile of x through shared memory, cast by its scales into x (per tensor)
//     and/or x^T (4-byte stores), coalesced both ways.
// The general kernels (any layout, float64 and float8 inputs): rows (a block per row), amax (per
// column or tensor, 32-column tiles) and cast (elementwise, or transposed by 32 x 32 tiles).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

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

constexpr int kFastRows = 32;  // rows per block of fast_rows
constexpr int kFastThreads = 256;
constexpr int kFastTile = 64;  // fast_tile's tile: 64 x 64 elements

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

template <int N>
struct alignas(N) Bytes {
  std::uint8_t val[N];
};

template <typename T, bool E4M3, bool COLUMN_AMAX>
__global__ void __launch_bounds__(kFastThreads)
    fast_rows_kernel(const T* __restrict__ x, std::int64_t rows, std::int64_t cols,
                     std::uint8_t* __restrict__ q, float* __restrict__ inverse,
                     unsigned int* __restrict__ column_amax, float format_max) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  using V = Vec<T, kVec>;
  using B = Bytes<kVec>;
  __shared__ float row_scale[kFastRows];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * kFastRows;
  const std::int64_t vectors = cols / kVec;
  for (int i = warp; i < kFastRows; i += kFastThreads / 32) {
    const std::int64_t r = r0 + i;
    float m = 0.0F;
    if (r < rows) {
      const V* row = reinterpret_cast<const V*>(x + r * cols);
      for (std::int64_t v = lane; v < vectors; v += 32) {
        const V a = row[v];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          m = nan_max(m, fabsf(static_cast<float>(a.val[k])));
        }
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
    }
    if (lane == 0) {
      const float s = group_scale(m, format_max);
      row_scale[i] = s;
      if (r < rows) {
        inverse[r] = 1.0F / s;
      }
    }
  }
  __syncthreads();
  const int block_rows = rows - r0 < kFastRows ? static_cast<int>(rows - r0) : kFastRows;
  for (std::int64_t v = threadIdx.x; v < vectors; v += kFastThreads) {
    float column_max[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      column_max[k] = 0.0F;
    }
    for (int i = 0; i < block_rows; ++i) {
      const V a = reinterpret_cast<const V*>(x + (r0 + i) * cols)[v];
      const float s = row_scale[i];
      B out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float f = static_cast<float>(a.val[k]);
        if constexpr (COLUMN_AMAX) {
          column_max[k] = nan_max(column_max[k], fabsf(f));
        }
        out.val[k] = cast<E4M3>(f, s, format_max);
      }
      reinterpret_cast<B*>(q + (r0 + i) * cols)[v] = out;
    }
    if constexpr (COLUMN_AMAX) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        atomicMax(column_amax + v * kVec + k, __float_as_uint(column_max[k]));
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kFastThreads)
    fast_amax_kernel(const T* __restrict__ x, std::int64_t vectors,
                     unsigned int* __restrict__ amax) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  using V = Vec<T, kVec>;
  __shared__ float partial[kFastThreads / 32];
  float m = 0.0F;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kFastThreads;
  for (std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * kFastThreads + threadIdx.x;
       v < vectors; v += stride) {
    const V a = reinterpret_cast<const V*>(x)[v];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      m = nan_max(m, fabsf(static_cast<float>(a.val[k])));
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
  }
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = m;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kFastThreads / 32; ++w) {
      m = nan_max(m, partial[w]);
    }
    atomicMax(amax, __float_as_uint(m));
  }
}

// A 64 x 64 tile of x cast into q_rows (x's layout, per-tensor scale only) and/or q_columns (x^T,
// per-column scales from amax[column] when `rowwise`, else the tensor's from amax[0]).
template <typename T, bool E4M3, bool ROWS_OUT, bool COLUMNS_OUT>
__global__ void __launch_bounds__(kFastThreads)
    fast_tile_kernel(const T* __restrict__ x, std::int64_t rows, std::int64_t cols, bool rowwise,
                     const unsigned int* __restrict__ amax, std::uint8_t* __restrict__ q_rows,
                     std::uint8_t* __restrict__ q_columns, float* __restrict__ inverse_rows,
                     float* __restrict__ inverse_columns, float format_max) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = kFastTile / kVec;  // vectors per tile row
  using V = Vec<T, kVec>;
  using B = Bytes<kVec>;
  __shared__ float tile[kFastTile][kFastTile + 1];
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kFastTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kFastTile;
  const float whole = rowwise ? 0.0F : group_scale(__uint_as_float(amax[0]), format_max);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    if (ROWS_OUT) {
      inverse_rows[0] = 1.0F / whole;
    }
    if (COLUMNS_OUT) {
      inverse_columns[0] = 1.0F / whole;
    }
  }
  for (int idx = static_cast<int>(threadIdx.x); idx < kFastTile * kPerRow; idx += kFastThreads) {
    const int i = idx / kPerRow;
    const int j = idx % kPerRow;
    const std::int64_t r = r0 + i;
    const std::int64_t c = c0 + static_cast<std::int64_t>(j) * kVec;
    if (r < rows && c < cols) {  // cols is a multiple of kVec: the whole vector is inside
      const V a = *reinterpret_cast<const V*>(x + r * cols + c);
      B out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float f = static_cast<float>(a.val[k]);
        tile[i][j * kVec + k] = f;
        if constexpr (ROWS_OUT) {
          out.val[k] = cast<E4M3>(f, whole, format_max);
        }
      }
      if constexpr (ROWS_OUT) {
        *reinterpret_cast<B*>(q_rows + r * cols + c) = out;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        tile[i][j * kVec + k] = 0.0F;
      }
    }
  }
  if constexpr (COLUMNS_OUT) {
    __syncthreads();
    // x^T: the tile's 64 columns as output rows of 64 bytes (the tile's rows), 4 bytes a thread.
    for (int idx = static_cast<int>(threadIdx.x); idx < kFastTile * (kFastTile / 4);
         idx += kFastThreads) {
      const int column = idx / (kFastTile / 4);
      const int word = idx % (kFastTile / 4);
      const std::int64_t out_row = c0 + column;
      if (out_row >= cols) {
        continue;
      }
      const float s = rowwise ? group_scale(__uint_as_float(amax[out_row]), format_max) : whole;
      if (rowwise && blockIdx.y == 0 && word == 0) {
        inverse_columns[out_row] = 1.0F / s;
      }
      const std::int64_t first = r0 + static_cast<std::int64_t>(word) * 4;
      if (first >= rows) {
        continue;
      }
      Bytes<4> b;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        b.val[k] = cast<E4M3>(tile[word * 4 + k][column], s, format_max);
      }
      std::uint8_t* dst = q_columns + out_row * rows + first;
      if (rows % 4 == 0) {
        *reinterpret_cast<Bytes<4>*>(dst) = b;
      } else {
        for (int k = 0; k < 4 && first + k < rows; ++k) {
          dst[k] = b.val[k];
        }
      }
    }
  }
}

// Whether x takes the fast kernels: float32, bfloat16 or float16, rows of whole 16-byte vectors
// starting 16-byte aligned.
bool fast_input(const at::Tensor& x) {
  const auto type = x.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) {
    return false;
  }
  const auto vec = 16 / static_cast<std::int64_t>(x.element_size());
  return x.size(1) % vec == 0 && reinterpret_cast<std::uintptr_t>(x.const_data_ptr()) % 16 == 0;
}

template <typename F>
void dispatch_fast(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float());
    case at::kBFloat16:
      return f(c10::BFloat16());
    default:
      return f(c10::Half());
  }
}

template <typename F>
void dispatch_format(bool e4m3, F&& f) {
  if (e4m3) {
    f(std::true_type());
  } else {
    f(std::false_type());
  }
}

dim3 tile_grid(std::int64_t rows, std::int64_t cols) {
  TORCH_CHECK((rows + kFastTile - 1) / kFastTile <= 65535, "d9d::float8_quantize: ", rows,
              " rows are more than the CUDA kernels take");
  return {static_cast<unsigned int>((cols + kFastTile - 1) / kFastTile),
          static_cast<unsigned int>((rows + kFastTile - 1) / kFastTile)};
}

// The largest magnitude of x (fast input) into a new [1] int tensor of float bits.
template <typename T>
at::Tensor tensor_amax(const at::Tensor& x, cudaStream_t stream) {
  auto amax = at::zeros({1}, x.options().dtype(at::kInt));
  const std::int64_t vectors = x.numel() / (16 / static_cast<std::int64_t>(sizeof(T)));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = static_cast<unsigned int>(
      std::min<std::int64_t>((vectors + kFastThreads - 1) / kFastThreads, 4LL * sms));
  fast_amax_kernel<T><<<std::max(blocks, 1U), kFastThreads, 0, stream>>>(
      static_cast<const T*>(x.const_data_ptr()), vectors,
      reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<int>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return amax;
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

// The fast paths of float8_quantize (x contiguous, fast_input).
void quantize_fast(const at::Tensor& x, bool e4m3, bool rowwise, bool transpose, at::Tensor& q,
                   at::Tensor& inverse, float format_max) {
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* out = static_cast<std::uint8_t*>(q.mutable_data_ptr());
  float* inv = inverse.mutable_data_ptr<float>();
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.const_data_ptr());
    dispatch_format(e4m3, [&](auto format_tag) {
      constexpr bool kE4M3 = decltype(format_tag)::value;
      if (rowwise && !transpose) {
        const auto blocks = static_cast<unsigned int>((rows + kFastRows - 1) / kFastRows);
        fast_rows_kernel<T, kE4M3, false>
            <<<blocks, kFastThreads, 0, stream>>>(in, rows, cols, out, inv, nullptr, format_max);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      at::Tensor amax;
      if (rowwise) {  // per column of x: the general amax kernel, then the tile
        amax = at::zeros({cols}, x.options().dtype(at::kInt));
        const Reader<T> read{in, nullptr, false, cols};
        const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                        static_cast<unsigned int>((rows + kAmaxSlab - 1) / kAmaxSlab));
        amax_kernel<T><<<grid, dim3(kTile, kTileRows), 0, stream>>>(
            read, rows, cols, true, reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<int>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else {
        amax = tensor_amax<T>(x, stream);
      }
      const auto* bits = reinterpret_cast<const unsigned int*>(amax.const_data_ptr<int>());
      if (transpose) {
        fast_tile_kernel<T, kE4M3, false, true><<<tile_grid(rows, cols), kFastThreads, 0, stream>>>(
            in, rows, cols, rowwise, bits, nullptr, out, nullptr, inv, format_max);
      } else {
        fast_tile_kernel<T, kE4M3, true, false><<<tile_grid(rows, cols), kFastThreads, 0, stream>>>(
            in, rows, cols, rowwise, bits, out, nullptr, inv, nullptr, format_max);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
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
  if (!x_scale.defined() && fast_input(x)) {
    quantize_fast(x, e4m3, rowwise, transpose, q, inverse, format_max);
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
    dispatch_format(e4m3, [&](auto e4m3_tag) {
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
    });
  });
  return {q, inverse};
}

// Rows and columns of x in one go: per row, fast_rows quantises the rows and takes the columns'
// maxima, then fast_tile writes x^T; per tensor, one maximum, then fast_tile writes both.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> float8_quantize_both_cuda(
    const at::Tensor& x_arg, at::ScalarType format, bool rowwise) {
  detail::check_float8_quantize(x_arg, at::Tensor(), format);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  if (rows == 0 || cols == 0 || !fast_input(x)) {
    auto [q_rows, s_rows] = float8_quantize_cuda(x, std::nullopt, format, rowwise, false);
    auto [q_columns, s_columns] = float8_quantize_cuda(x, std::nullopt, format, rowwise, true);
    return {q_rows, s_rows, q_columns, s_columns};
  }
  const float format_max = float8_max(format);
  const auto scale_options = x.options().dtype(at::kFloat);
  auto q_rows = at::empty({rows, cols}, x.options().dtype(format));
  auto q_columns = at::empty({cols, rows}, x.options().dtype(format));
  auto s_rows = rowwise ? at::empty({rows, 1}, scale_options) : at::empty({}, scale_options);
  auto s_columns = rowwise ? at::empty({cols, 1}, scale_options) : at::empty({}, scale_options);
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.const_data_ptr());
    dispatch_format(format == at::kFloat8_e4m3fn, [&](auto format_tag) {
      constexpr bool kE4M3 = decltype(format_tag)::value;
      at::Tensor amax;
      if (rowwise) {
        amax = at::zeros({cols}, x.options().dtype(at::kInt));
        const auto blocks = static_cast<unsigned int>((rows + kFastRows - 1) / kFastRows);
        fast_rows_kernel<T, kE4M3, true><<<blocks, kFastThreads, 0, stream>>>(
            in, rows, cols, static_cast<std::uint8_t*>(q_rows.mutable_data_ptr()),
            s_rows.mutable_data_ptr<float>(),
            reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<int>()), format_max);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        fast_tile_kernel<T, kE4M3, false, true><<<tile_grid(rows, cols), kFastThreads, 0, stream>>>(
            in, rows, cols, true, reinterpret_cast<const unsigned int*>(amax.const_data_ptr<int>()),
            nullptr, static_cast<std::uint8_t*>(q_columns.mutable_data_ptr()), nullptr,
            s_columns.mutable_data_ptr<float>(), format_max);
      } else {
        amax = tensor_amax<T>(x, stream);
        fast_tile_kernel<T, kE4M3, true, true><<<tile_grid(rows, cols), kFastThreads, 0, stream>>>(
            in, rows, cols, false,
            reinterpret_cast<const unsigned int*>(amax.const_data_ptr<int>()),
            static_cast<std::uint8_t*>(q_rows.mutable_data_ptr()),
            static_cast<std::uint8_t*>(q_columns.mutable_data_ptr()),
            s_rows.mutable_data_ptr<float>(), s_columns.mutable_data_ptr<float>(), format_max);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {q_rows, s_rows, q_columns, s_columns};
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("float8_quantize", &d9d::kernels::float8_quantize_cuda);
  m.impl("float8_quantize_both", &d9d::kernels::float8_quantize_both_cuda);
}
