// d9d/kernels/float8.cu — CUDA kernels of d9d::float8_quantize (the definition is in
// d9d/kernels/float8.hpp; these reproduce the CPU reference bit for bit: the same float32
// products by power-of-two scales, IEEE division for the scale, round-to-nearest-even casts).
//
// Fast paths (float32, bfloat16, float16 and float8 x with rows of whole 16-byte vectors, aligned),
// blocks of 32 x 8 threads, 16-byte loads:
//   - fast_rows: a warp per row: its largest magnitude, then the row cast;
//   - fast_column_amax: the columns' largest magnitudes, 32 rows x 32 vectors a block, atomicMax
//     per block and column on the float's bits (which order like the non-negative floats and put
//     NaN above infinity);
//   - fast_amax: the largest magnitude of the tensor (grid-stride, one atomicMax per block);
//   - fast_tile: a 64 x 64 tile of x through shared memory, cast by its scales into x (per tensor)
//     and/or x^T (4-byte stores), coalesced both ways.
// The general kernels (any layout, float64 and float8 inputs): rows (a block per row), amax (per
// column or tensor, 32-column tiles) and cast (elementwise, or transposed by 32 x 32 tiles).
// float8_amax_bits and float8_quantize_with_amax (d9d/kernels/float8_sharded.hpp) are the
// per-tensor path split at its maximum: fast_amax or amax_kernel, then fast_tile or cast_kernel
// reading the given maximum.
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
#include <d9d/kernels/float8_sharded.hpp>

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

// x[i] as float32, times its dequantisation scale when x is float8, times its column's factor when
// one is given (a non-float8 x's rows).
template <typename T>
struct Reader {
  const T* x;
  const float* scale;  // null unless x is float8
  bool scale_per_row;
  std::int64_t cols;
  const float* column_factor;  // null unless given
  __device__ __forceinline__ float operator()(std::int64_t r, std::int64_t c) const {
    float v = static_cast<float>(x[r * cols + c]);
    if (scale != nullptr) {
      v = v * scale[scale_per_row ? r : 0];
    }
    return column_factor == nullptr ? v : v * column_factor[c];
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

constexpr int kAmaxRows = 32;      // rows per block of fast_column_amax
constexpr int kFastThreads = 256;  // 32 x 8
constexpr int kFastTile = 64;      // fast_tile's tile: 64 x 64 elements

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

template <int N>
struct alignas(N) Bytes {
  std::uint8_t val[N];
};

// 16-byte vectors of x as floats: x[r, v * kVec + k], times the row's (or the tensor's) scale for a
// float8 x, times the column's factor when one is given. x's rows are whole vectors
// (cols % kVec == 0) and start 16-byte aligned.
template <typename T>
struct FastReader {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const T* x;
  const float* scale;  // null unless x is float8
  bool scale_per_row;
  std::int64_t cols;
  const float* column_factor;  // null unless given
  __device__ __forceinline__ void operator()(std::int64_t r, std::int64_t v,
                                             float (&out)[kVec]) const {
    const auto a = reinterpret_cast<const Vec<T, kVec>*>(x + r * cols)[v];
    const float factor = scale == nullptr ? 1.0F : scale[scale_per_row ? r : 0];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      out[k] =
          scale == nullptr ? static_cast<float>(a.val[k]) : static_cast<float>(a.val[k]) * factor;
    }
    if (column_factor != nullptr) {
      // kVec factors in 16-byte loads (quantize_fast aligns the factor).
      const auto* m = reinterpret_cast<const float4*>(column_factor + v * kVec);
#pragma unroll
      for (int i = 0; i < kVec / 4; ++i) {
        const float4 f = m[i];
        out[4 * i] = out[4 * i] * f.x;
        out[4 * i + 1] = out[4 * i + 1] * f.y;
        out[4 * i + 2] = out[4 * i + 2] * f.z;
        out[4 * i + 3] = out[4 * i + 3] * f.w;
      }
    }
  }
};

// A warp per row of x (8 rows per block of 32 x 8 threads): the row's largest magnitude from
// 16-byte vectors, then the row cast by its scale (the second read mostly from cache), 8-byte
// stores for 2-byte inputs.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(kFastThreads)
    fast_rows_kernel(FastReader<T> read, std::int64_t rows, std::uint8_t* __restrict__ q,
                     float* __restrict__ inverse, float format_max) {
  constexpr int kVec = FastReader<T>::kVec;
  using B = Bytes<kVec>;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * 8 + threadIdx.y;
  if (r >= rows) {
    return;  // a whole warp: no shuffle below is left short
  }
  const int lane = static_cast<int>(threadIdx.x);
  const std::int64_t cols = read.cols;
  const std::int64_t vectors = cols / kVec;
  float f[kVec];
  float m = 0.0F;
  for (std::int64_t v = lane; v < vectors; v += 32) {
    read(r, v, f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      m = nan_max(m, fabsf(f[k]));
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
  }
  const float s = group_scale(m, format_max);
  if (lane == 0) {
    inverse[r] = 1.0F / s;
  }
  for (std::int64_t v = lane; v < vectors; v += 32) {
    read(r, v, f);
    B out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      out.val[k] = cast<E4M3>(f[k], s, format_max);
    }
    reinterpret_cast<B*>(q + r * cols)[v] = out;
  }
}

// The columns' largest magnitudes of 32 rows x 32 column vectors per block (threads 32 x 8, four
// rows each), reduced over the block's rows in shared memory ([k][y][x]: no bank conflicts) and
// added to column_amax (atomicMax on the floats' bits, which order like non-negative floats and
// put NaN above infinity).
template <typename T>
__global__ void __launch_bounds__(kFastThreads)
    fast_column_amax_kernel(FastReader<T> read, std::int64_t rows,
                            unsigned int* __restrict__ column_amax) {
  constexpr int kVec = FastReader<T>::kVec;
  __shared__ float partial[kVec][8][32];
  const int tx = static_cast<int>(threadIdx.x);
  const int ty = static_cast<int>(threadIdx.y);
  const std::int64_t vectors = read.cols / kVec;
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * 32 + tx;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kAmaxRows;
  const std::int64_t r1 = r0 + kAmaxRows < rows ? r0 + kAmaxRows : rows;
  float m[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    m[k] = 0.0F;
  }
  if (v < vectors) {
    float f[kVec];
#pragma unroll
    for (int i = 0; i < kAmaxRows / 8; ++i) {
      const std::int64_t r = r0 + ty + 8 * i;
      if (r < r1) {
        read(r, v, f);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          m[k] = nan_max(m[k], fabsf(f[k]));
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    partial[k][ty][tx] = m[k];
  }
  __syncthreads();
  if (v >= vectors) {
    return;
  }
  for (int k = ty; k < kVec; k += 8) {
    float best = partial[k][0][tx];
#pragma unroll
    for (int y = 1; y < 8; ++y) {
      best = nan_max(best, partial[k][y][tx]);
    }
    atomicMax(column_amax + v * kVec + k, __float_as_uint(best));
  }
}

// The tensor's largest magnitude (grid-stride over its vectors, one atomicMax per block).
template <typename T>
__global__ void __launch_bounds__(kFastThreads)
    fast_amax_kernel(FastReader<T> read, std::int64_t rows, unsigned int* __restrict__ amax) {
  constexpr int kVec = FastReader<T>::kVec;
  __shared__ float partial[kFastThreads / 32];
  const std::int64_t per_row = read.cols / kVec;
  const std::int64_t vectors = rows * per_row;
  const int thread = static_cast<int>(threadIdx.y * 32 + threadIdx.x);
  float m = 0.0F;
  float f[kVec];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kFastThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kFastThreads + thread; i < vectors;
       i += stride) {
    read(i / per_row, i % per_row, f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      m = nan_max(m, fabsf(f[k]));
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = nan_max(m, __shfl_xor_sync(0xFFFFFFFFU, m, offset));
  }
  if (thread % 32 == 0) {
    partial[thread / 32] = m;
  }
  __syncthreads();
  if (thread == 0) {
    for (int w = 1; w < kFastThreads / 32; ++w) {
      m = nan_max(m, partial[w]);
    }
    atomicMax(amax, __float_as_uint(m));
  }
}

// A 64 x 64 tile of x cast into q_rows (x's layout, per-tensor scale only) and/or q_columns (x^T,
// per-column scales from amax[column] when `rowwise`, else the tensor's from amax[0]), through
// shared memory so that reads of x and writes of x^T (4 bytes a thread) are both coalesced.
template <typename T, bool E4M3, bool ROWS_OUT, bool COLUMNS_OUT>
__global__ void __launch_bounds__(kFastThreads)
    fast_tile_kernel(FastReader<T> read, std::int64_t rows, bool rowwise,
                     const unsigned int* __restrict__ amax, std::uint8_t* __restrict__ q_rows,
                     std::uint8_t* __restrict__ q_columns, float* __restrict__ inverse_rows,
                     float* __restrict__ inverse_columns, float format_max) {
  constexpr int kVec = FastReader<T>::kVec;
  constexpr int kPerRow = kFastTile / kVec;  // vectors per tile row
  using B = Bytes<kVec>;
  __shared__ float tile[kFastTile][kFastTile + 1];
  const std::int64_t cols = read.cols;
  const int thread = static_cast<int>(threadIdx.y * 32 + threadIdx.x);
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kFastTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kFastTile;
  const float whole = rowwise ? 0.0F : group_scale(__uint_as_float(amax[0]), format_max);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && thread == 0) {
    if (ROWS_OUT) {
      inverse_rows[0] = 1.0F / whole;
    }
    if (COLUMNS_OUT) {
      inverse_columns[0] = 1.0F / whole;
    }
  }
  float f[kVec];
  for (int idx = thread; idx < kFastTile * kPerRow; idx += kFastThreads) {
    const int i = idx / kPerRow;
    const int j = idx % kPerRow;
    const std::int64_t r = r0 + i;
    const std::int64_t c = c0 + static_cast<std::int64_t>(j) * kVec;
    if (r < rows && c < cols) {  // cols is a multiple of kVec: the whole vector is inside
      read(r, c / kVec, f);
      B out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        tile[i][j * kVec + k] = f[k];
        if constexpr (ROWS_OUT) {
          out.val[k] = cast<E4M3>(f[k], whole, format_max);
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
    for (int idx = thread; idx < kFastTile * (kFastTile / 4); idx += kFastThreads) {
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

// A 64 x 64 tile of bytes transposed through shared memory: 16-byte loads along x's rows, 4-byte
// stores along x^T's (x's columns a multiple of 16, its rows of 4, 16-byte aligned).
__global__ void __launch_bounds__(kFastThreads)
    byte_transpose_kernel(const std::uint8_t* __restrict__ x, std::int64_t rows, std::int64_t cols,
                          std::uint8_t* __restrict__ out) {
  __shared__ std::uint8_t tile[kFastTile][kFastTile + 4];
  const int thread = static_cast<int>(threadIdx.y * 32 + threadIdx.x);
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kFastTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kFastTile;
  {
    const int i = thread / 4;  // 64 rows x 4 vectors of 16 bytes: one per thread
    const int j = thread % 4;
    const std::int64_t r = r0 + i;
    const std::int64_t c = c0 + static_cast<std::int64_t>(j) * 16;
    if (r < rows && c < cols) {
      const auto v = *reinterpret_cast<const Bytes<16>*>(x + r * cols + c);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        tile[i][j * 16 + k] = v.val[k];
      }
    }
  }
  __syncthreads();
  for (int idx = thread; idx < kFastTile * (kFastTile / 4); idx += kFastThreads) {
    const int column = idx / (kFastTile / 4);
    const int word = idx % (kFastTile / 4);
    const std::int64_t out_row = c0 + column;
    const std::int64_t first = r0 + static_cast<std::int64_t>(word) * 4;
    if (out_row >= cols || first >= rows) {
      continue;
    }
    Bytes<4> b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      b.val[k] = tile[word * 4 + k][column];
    }
    *reinterpret_cast<Bytes<4>*>(out + out_row * rows + first) = b;
  }
}

// Whether x takes the fast kernels: float32, bfloat16, float16 or float8, rows of whole 16-byte
// vectors, 16-byte aligned.
bool fast_input(const at::Tensor& x) {
  const auto type = x.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf &&
      type != at::kFloat8_e4m3fn && type != at::kFloat8_e5m2) {
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
    case at::kHalf:
      return f(c10::Half());
    case at::kFloat8_e4m3fn:
      return f(c10::Float8_e4m3fn());
    default:
      return f(c10::Float8_e5m2());
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

const dim3 kFastBlock(32, 8);

dim3 tile_grid(std::int64_t rows, std::int64_t cols) {
  TORCH_CHECK((rows + kFastTile - 1) / kFastTile <= 65535, "d9d::float8_quantize: ", rows,
              " rows are more than the CUDA kernels take");
  return {static_cast<unsigned int>((cols + kFastTile - 1) / kFastTile),
          static_cast<unsigned int>((rows + kFastTile - 1) / kFastTile)};
}

unsigned int* bits_of(at::Tensor& amax) {
  return reinterpret_cast<unsigned int*>(amax.mutable_data_ptr<int>());
}

// The largest magnitude of the tensor, or of each column (`per_column`), as float bits.
template <typename T>
at::Tensor fast_amax(const FastReader<T>& read, std::int64_t rows, bool per_column,
                     const at::TensorOptions& options, cudaStream_t stream) {
  constexpr int kVec = FastReader<T>::kVec;
  auto amax = at::zeros({per_column ? read.cols : 1}, options.dtype(at::kInt));
  const std::int64_t vectors = read.cols / kVec;
  if (per_column) {
    const dim3 grid(static_cast<unsigned int>((vectors + 31) / 32),
                    static_cast<unsigned int>((rows + kAmaxRows - 1) / kAmaxRows));
    TORCH_CHECK(grid.y <= 65535, "d9d::float8_quantize: too many rows for the CUDA kernels");
    fast_column_amax_kernel<T><<<grid, kFastBlock, 0, stream>>>(read, rows, bits_of(amax));
  } else {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const auto blocks = static_cast<unsigned int>(std::max<std::int64_t>(
        1, std::min<std::int64_t>((rows * vectors + kFastThreads - 1) / kFastThreads, 4LL * sms)));
    fast_amax_kernel<T><<<blocks, kFastBlock, 0, stream>>>(read, rows, bits_of(amax));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return amax;
}

// The quantisations on the fast kernels: `rows_out` (x's layout) and/or `columns_out` (x^T), each
// with its scale tensor; x contiguous and fast_input; `x_scale` for a float8 x; `rows_factor`
// ([1, cols], rowwise only) multiplies x's columns for the rows.
void quantize_fast(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& rows_factor,
                   bool e4m3, bool rowwise, at::Tensor* rows_out, at::Tensor* rows_scale,
                   at::Tensor* columns_out, at::Tensor* columns_scale, float format_max) {
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto bytes = [](at::Tensor* t) {
    return t == nullptr ? nullptr : static_cast<std::uint8_t*>(t->mutable_data_ptr());
  };
  const auto floats = [](at::Tensor* t) {
    return t == nullptr ? nullptr : t->mutable_data_ptr<float>();
  };
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const FastReader<T> read{static_cast<const T*>(x.const_data_ptr()),
                             x_scale.defined() ? x_scale.const_data_ptr<float>() : nullptr,
                             x_scale.defined() && x_scale.dim() == 2, cols, nullptr};
    // The factor read in 16-byte vectors: a copy when its storage is not aligned so (a view
    // into a FullyShard unit's float8 storage may not be).
    const at::Tensor factor =
        rows_factor.defined() &&
                reinterpret_cast<std::uintptr_t>(rows_factor.const_data_ptr()) % 16 != 0
            ? rows_factor.clone()
            : rows_factor;
    FastReader<T> read_rows = read;
    read_rows.column_factor = factor.defined() ? factor.const_data_ptr<float>() : nullptr;
    dispatch_format(e4m3, [&](auto format_tag) {
      constexpr bool kE4M3 = decltype(format_tag)::value;
      const auto row_blocks = static_cast<unsigned int>((rows + 7) / 8);
      if (rowwise) {
        if (rows_out != nullptr) {
          fast_rows_kernel<T, kE4M3><<<row_blocks, kFastBlock, 0, stream>>>(
              read_rows, rows, bytes(rows_out), floats(rows_scale), format_max);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        at::Tensor amax;
        if (columns_out != nullptr) {
          amax = fast_amax(read, rows, /*per_column=*/true, x.options(), stream);
        }
        if (columns_out != nullptr) {
          fast_tile_kernel<T, kE4M3, false, true><<<tile_grid(rows, cols), kFastBlock, 0, stream>>>(
              read, rows, true, bits_of(amax), nullptr, bytes(columns_out), nullptr,
              floats(columns_scale), format_max);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        return;
      }
      auto amax = fast_amax(read, rows, /*per_column=*/false, x.options(), stream);
      if (rows_out != nullptr && columns_out != nullptr) {
        fast_tile_kernel<T, kE4M3, true, true><<<tile_grid(rows, cols), kFastBlock, 0, stream>>>(
            read, rows, false, bits_of(amax), bytes(rows_out), bytes(columns_out),
            floats(rows_scale), floats(columns_scale), format_max);
      } else if (rows_out != nullptr) {
        fast_tile_kernel<T, kE4M3, true, false><<<tile_grid(rows, cols), kFastBlock, 0, stream>>>(
            read, rows, false, bits_of(amax), bytes(rows_out), nullptr, floats(rows_scale), nullptr,
            format_max);
      } else {
        fast_tile_kernel<T, kE4M3, false, true><<<tile_grid(rows, cols), kFastBlock, 0, stream>>>(
            read, rows, false, bits_of(amax), nullptr, bytes(columns_out), nullptr,
            floats(columns_scale), format_max);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
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

// The general kernels, for any input (float64, unaligned or odd rows); `factor` ([1, cols]) as
// float8_quantize's for a non-float8 x.
void quantize_general(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& factor,
                      bool e4m3, bool rowwise, bool transpose, at::Tensor& q, at::Tensor& inverse,
                      float format_max) {
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  TORCH_CHECK((rowwise && !transpose) || (rows + kTile - 1) / kTile <= 65535,
              "d9d::float8_quantize: x ", x.sizes(), " has more rows than the CUDA kernels take");
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto* out = static_cast<std::uint8_t*>(q.mutable_data_ptr());
  float* inv = inverse.mutable_data_ptr<float>();
  const float* scale = x_scale.defined() ? x_scale.const_data_ptr<float>() : nullptr;
  const bool scale_per_row = x_scale.defined() && x_scale.dim() == 2;
  const std::int64_t groups = rowwise ? (transpose ? cols : rows) : 1;
  dispatch_input(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const Reader<T> read{static_cast<const T*>(x.const_data_ptr()), scale, scale_per_row, cols,
                         factor.defined() ? factor.const_data_ptr<float>() : nullptr};
    dispatch_format(e4m3, [&](auto e4m3_tag) {
      constexpr bool kE4M3 = decltype(e4m3_tag)::value;
      if (rowwise && !transpose) {
        quantize_rows_kernel<T, kE4M3><<<static_cast<unsigned int>(rows), kRowThreads, 0, stream>>>(
            read, out, inv, cols, format_max);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      auto amax = at::zeros({groups}, x.options().dtype(at::kInt));
      const dim3 threads(kTile, kTileRows);
      const dim3 amax_grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                           static_cast<unsigned int>((rows + kAmaxSlab - 1) / kAmaxSlab));
      amax_kernel<T><<<amax_grid, threads, 0, stream>>>(read, rows, cols, rowwise, bits_of(amax));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const dim3 cast_grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                           static_cast<unsigned int>((rows + kTile - 1) / kTile));
      cast_kernel<T, kE4M3><<<cast_grid, threads, 0, stream>>>(read, rows, cols, transpose, rowwise,
                                                               bits_of(amax), out, inv, format_max);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

at::Tensor new_scale(const at::Tensor& x, bool rowwise, std::int64_t groups) {
  const auto options = x.options().dtype(at::kFloat);
  return rowwise ? at::empty({groups, 1}, options) : at::empty({}, options);
}

std::tuple<at::Tensor, at::Tensor> float8_quantize_cuda(
    const at::Tensor& x_arg, const std::optional<at::Tensor>& x_scale_arg, at::ScalarType format,
    bool rowwise, bool transpose) {
  const at::Tensor scale_in = x_scale_arg.value_or(at::Tensor());
  detail::check_float8_quantize(x_arg, scale_in, format, rowwise, transpose);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  // A non-float8 x's x_scale is its factor per column.
  const bool factor_given = detail::is_column_factor(x_arg, scale_in);
  const at::Tensor given = scale_in.defined() ? scale_in.contiguous() : scale_in;
  const at::Tensor x_scale = factor_given ? at::Tensor() : given;
  const at::Tensor factor = factor_given ? given : at::Tensor();
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  const float format_max = float8_max(format);
  const bool e4m3 = format == at::kFloat8_e4m3fn;
  auto inverse = new_scale(x, rowwise, transpose ? cols : rows);
  auto q = transpose ? at::empty({cols, rows}, x.options().dtype(format))
                     : at::empty({rows, cols}, x.options().dtype(format));
  if (rows == 0 || cols == 0) {
    if (inverse.numel() > 0) {
      inverse.fill_(1.0);
    }
    return {q, inverse};
  }
  if (fast_input(x)) {
    quantize_fast(x, x_scale, factor, e4m3, rowwise, transpose ? nullptr : &q,
                  transpose ? nullptr : &inverse, transpose ? &q : nullptr,
                  transpose ? &inverse : nullptr, format_max);
  } else {
    quantize_general(x, x_scale, factor, e4m3, rowwise, transpose, q, inverse, format_max);
  }
  return {q, inverse};
}

// Rows and columns of x in one go: per row, fast_rows quantises the rows (times rows_factor when
// given), the columns' maxima and fast_tile write x^T; per tensor, one maximum, then fast_tile
// writes both.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> float8_quantize_both_cuda(
    const at::Tensor& x_arg, at::ScalarType format, bool rowwise,
    const std::optional<at::Tensor>& rows_factor_arg) {
  TORCH_CHECK(x_arg.scalar_type() != at::kFloat8_e4m3fn && x_arg.scalar_type() != at::kFloat8_e5m2,
              "d9d::float8_quantize_both: x is not float8 (use float8_quantize with its scale)");
  const at::Tensor factor_in = rows_factor_arg.value_or(at::Tensor());
  detail::check_float8_quantize(x_arg, factor_in, format, rowwise, false);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor rows_factor = factor_in.defined() ? factor_in.contiguous() : factor_in;
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  if (rows == 0 || cols == 0 || !fast_input(x)) {
    auto [q_rows, s_rows] = float8_quantize_cuda(x, rows_factor_arg, format, rowwise, false);
    auto [q_columns, s_columns] = float8_quantize_cuda(x, std::nullopt, format, rowwise, true);
    return {q_rows, s_rows, q_columns, s_columns};
  }
  auto q_rows = at::empty({rows, cols}, x.options().dtype(format));
  auto q_columns = at::empty({cols, rows}, x.options().dtype(format));
  auto s_rows = new_scale(x, rowwise, rows);
  auto s_columns = new_scale(x, rowwise, cols);
  quantize_fast(x, at::Tensor(), rows_factor, format == at::kFloat8_e4m3fn, rowwise, &q_rows,
                &s_rows, &q_columns, &s_columns, float8_max(format));
  return {q_rows, s_rows, q_columns, s_columns};
}

// The largest magnitude of x as float bits (int32, 0-dimensional), as the per-tensor quantisation
// computes it.
at::Tensor float8_amax_bits_cuda(const at::Tensor& x_arg) {
  detail::check_float8_with_amax(x_arg, at::Tensor(), at::kFloat8_e4m3fn);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  if (rows == 0 || cols == 0) {
    return at::zeros({}, x.options().dtype(at::kInt));
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor amax;
  if (fast_input(x)) {
    dispatch_fast(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const FastReader<T> read{static_cast<const T*>(x.const_data_ptr()), nullptr, false, cols,
                               nullptr};
      amax = fast_amax(read, rows, /*per_column=*/false, x.options(), stream);
    });
  } else {
    amax = at::zeros({1}, x.options().dtype(at::kInt));
    dispatch_input(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const Reader<T> read{static_cast<const T*>(x.const_data_ptr()), nullptr, false, cols,
                           nullptr};
      const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                      static_cast<unsigned int>((rows + kAmaxSlab - 1) / kAmaxSlab));
      amax_kernel<T>
          <<<grid, dim3(kTile, kTileRows), 0, stream>>>(read, rows, cols, false, bits_of(amax));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return amax.reshape(at::IntArrayRef{});  // [1] -> 0-dimensional (view({}) would pick view(dtype))
}

// x cast with the scale of the given maximum: fast_tile (rows only) or cast_kernel, launched with
// one block at least so that the scale is written for an empty x too.
std::tuple<at::Tensor, at::Tensor> float8_quantize_with_amax_cuda(const at::Tensor& x_arg,
                                                                  const at::Tensor& amax_arg,
                                                                  at::ScalarType format) {
  detail::check_float8_with_amax(x_arg, amax_arg, format);
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const at::Tensor amax = amax_arg.reshape({1}).contiguous();
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  const float format_max = float8_max(format);
  auto q = at::empty({rows, cols}, x.options().dtype(format));
  auto inverse = at::empty({}, x.options().dtype(at::kFloat));
  const auto* bits = reinterpret_cast<const unsigned int*>(amax.const_data_ptr<int>());
  auto* out = static_cast<std::uint8_t*>(q.mutable_data_ptr());
  float* inv = inverse.mutable_data_ptr<float>();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const std::int64_t some_rows = std::max<std::int64_t>(rows, 1);
  const std::int64_t some_cols = std::max<std::int64_t>(cols, 1);
  dispatch_format(format == at::kFloat8_e4m3fn, [&](auto format_tag) {
    constexpr bool kE4M3 = decltype(format_tag)::value;
    if (fast_input(x)) {
      dispatch_fast(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        const FastReader<T> read{static_cast<const T*>(x.const_data_ptr()), nullptr, false, cols,
                                 nullptr};
        fast_tile_kernel<T, kE4M3, true, false>
            <<<tile_grid(some_rows, some_cols), kFastBlock, 0, stream>>>(
                read, rows, false, bits, out, nullptr, inv, nullptr, format_max);
      });
    } else {
      dispatch_input(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        const Reader<T> read{static_cast<const T*>(x.const_data_ptr()), nullptr, false, cols,
                             nullptr};
        const dim3 grid(static_cast<unsigned int>((some_cols + kTile - 1) / kTile),
                        static_cast<unsigned int>((some_rows + kTile - 1) / kTile));
        cast_kernel<T, kE4M3><<<grid, dim3(kTile, kTileRows), 0, stream>>>(
            read, rows, cols, false, false, bits, out, inv, format_max);
      });
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, inverse};
}

// A float8 matrix's bytes transposed: byte_transpose_kernel where the shape and alignment let it,
// else ATen's strided copy.
at::Tensor float8_transpose_cuda(const at::Tensor& x_arg) {
  TORCH_CHECK(x_arg.dim() == 2 && (x_arg.scalar_type() == at::kFloat8_e4m3fn ||
                                   x_arg.scalar_type() == at::kFloat8_e5m2),
              "d9d::float8_transpose: x is a 2-D float8 tensor, got ", x_arg.scalar_type(),
              " with ", x_arg.dim(), " dimensions");
  const c10::cuda::CUDAGuard guard(x_arg.device());
  const at::Tensor x = x_arg.contiguous();
  const std::int64_t rows = x.size(0);
  const std::int64_t cols = x.size(1);
  if (rows == 0 || cols == 0 || cols % 16 != 0 || rows % 4 != 0 ||
      reinterpret_cast<std::uintptr_t>(x.const_data_ptr()) % 16 != 0) {
    return x.view(at::kByte).t().contiguous().view(x.scalar_type());
  }
  auto out = at::empty({cols, rows}, x.options());
  byte_transpose_kernel<<<tile_grid(rows, cols), kFastBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const std::uint8_t*>(x.const_data_ptr()), rows, cols,
      static_cast<std::uint8_t*>(out.mutable_data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace d9d::kernels

TORCH_LIBRARY_IMPL(d9d, CUDA, m) {
  m.impl("float8_quantize", &d9d::kernels::float8_quantize_cuda);
  m.impl("float8_quantize_both", &d9d::kernels::float8_quantize_both_cuda);
  m.impl("float8_transpose", &d9d::kernels::float8_transpose_cuda);
  m.impl("float8_amax_bits", &d9d::kernels::float8_amax_bits_cuda);
  m.impl("float8_quantize_with_amax", &d9d::kernels::float8_quantize_with_amax_cuda);
}
