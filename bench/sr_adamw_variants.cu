// bench/sr_adamw_variants.cu — launch-shape and arithmetic variants of the stochastic-rounding
// AdamW update (kernels/stochastic.cu) on one flat tensor, outside LibTorch, timed with CUDA
// events: how far the update is from the H200's bandwidth and what moves it. Bytes per element:
// 22 with float32 moments (read p, g, m, v; write p, m, v), 14 with bfloat16 moments.
//
//   tools/gpu/sr-adamw-variants          # on the device: nvcc -O3 -arch=sm_90, then run
//
// "lib": the library's loop (splitmix64 bits, stochastic rounding of every bfloat16 store) with
// UNROLL groups of four elements per thread, THREADS per block and CHUNK elements per block; MATH 0
// is torch's formula with IEEE divisions, 1 fast divisions, 2 no AdamW at all (the memory pattern,
// random bits and rounding only). Results in docs/kernels.md.
#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      return 1;                                      \
    }                                                \
  } while (0)

using Bits = uint16_t;
struct S {
  float lr, b1, b2, eps, wd, step_size, bc2;
};

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ float b2f(Bits b) { return __uint_as_float(uint32_t(b) << 16); }
__device__ __forceinline__ Bits sr(float v, uint32_t r) {
  uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7F800000U) == 0x7F800000U)
    return Bits((bits >> 16) | (((bits & 0x7FFFFF) != 0) ? 0x40 : 0));
  bits += r & 0xFFFFU;
  return Bits(bits >> 16);
}
__device__ __forceinline__ float adam(float p, float g, float& m, float& v, const S& s) {
  p *= 1.0f - s.lr * s.wd;
  m = s.b1 * m + (1.0f - s.b1) * g;
  v = s.b2 * v + (1.0f - s.b2) * g * g;
  const float denom = sqrtf(v) / s.bc2 + s.eps;
  return p - s.step_size * m / denom;
}
__device__ __forceinline__ float adam_fast(float p, float g, float& m, float& v, const S& s) {
  p *= 1.0f - s.lr * s.wd;
  m = s.b1 * m + (1.0f - s.b1) * g;
  v = s.b2 * v + (1.0f - s.b2) * g * g;
  const float denom = __fsqrt_rn(v) * (1.0f / s.bc2) + s.eps;  // same as sqrtf; reciprocal mult
  return p - __fdividef(s.step_size * m, denom);
}

// Four elements at a time: 16-byte loads of float32, 8-byte loads of bfloat16.
__device__ __forceinline__ void ld4(const float* p, float (&o)[4]) {
  float4 x = *reinterpret_cast<const float4*>(p);
  o[0] = x.x;
  o[1] = x.y;
  o[2] = x.z;
  o[3] = x.w;
}
__device__ __forceinline__ void ld4(const Bits* p, float (&o)[4]) {
  uint2 x = *reinterpret_cast<const uint2*>(p);
  o[0] = b2f(x.x & 0xFFFF);
  o[1] = b2f(x.x >> 16);
  o[2] = b2f(x.y & 0xFFFF);
  o[3] = b2f(x.y >> 16);
}
__device__ __forceinline__ void st4(float* p, const float (&o)[4], const uint32_t (&)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]);
}
__device__ __forceinline__ void st4(Bits* p, const float (&o)[4], const uint32_t (&r)[4]) {
  uint2 x;
  x.x = sr(o[0], r[0]) | (uint32_t(sr(o[1], r[1])) << 16);
  x.y = sr(o[2], r[2]) | (uint32_t(sr(o[3], r[3])) << 16);
  *reinterpret_cast<uint2*>(p) = x;
}

// Library-shaped kernel: splitmix64 bits per element, three 16-bit slices (p, m, v).
template <class SM, int UNROLL, int THREADS, int MATH = 0>
__global__ void __launch_bounds__(THREADS)
    k_lib(Bits* __restrict__ P, const Bits* __restrict__ G, SM* __restrict__ M, SM* __restrict__ V,
          int64_t n, S s, uint64_t seed, int64_t chunk) {
  const int64_t start = int64_t(blockIdx.x) * chunk;
  const int64_t end = min(start + chunk, n);
  constexpr int64_t kStride = 4 * int64_t(THREADS);
  for (int64_t first = start + 4 * int64_t(threadIdx.x); first < end; first += UNROLL * kStride) {
    float p[UNROLL][4], g[UNROLL][4], m[UNROLL][4], v[UNROLL][4];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = first + u * kStride;
      if (i + 4 <= end) {
        ld4(P + i, p[u]);
        ld4(G + i, g[u]);
        ld4(M + i, m[u]);
        ld4(V + i, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = first + u * kStride;
      if (i + 4 > end) continue;
      uint32_t rp[4], rm[4], rv[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t r = mix64(seed ^ uint64_t(i + k));
        rp[k] = uint32_t(r);
        rm[k] = uint32_t(r >> 16);
        rv[k] = uint32_t(r >> 32);
        if constexpr (MATH == 0)
          p[u][k] = adam(p[u][k], g[u][k], m[u][k], v[u][k], s);
        else if constexpr (MATH == 1)
          p[u][k] = adam_fast(p[u][k], g[u][k], m[u][k], v[u][k], s);
        else {
          float mm = m[u][k], vv = v[u][k];
          p[u][k] = p[u][k] + g[u][k];
          m[u][k] = mm + 1.0f;
          v[u][k] = vv * 0.5f;
        }
      }
      st4(P + i, p[u], rp);
      st4(M + i, m[u], rm);
      st4(V + i, v[u], rv);
    }
  }
}

__global__ void k_fill(uint32_t* d, int64_t words, uint32_t salt, uint32_t mask, uint32_t orv) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x)
    d[i] = (mix32(uint32_t(i) ^ salt) & mask) | orv;
}
template <class F>
float timeit(F f, int iters) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();
  f();
  cudaDeviceSynchronize();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / iters;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : (int64_t(600) << 20);
  const double nominal = 4.8e12;
  Bits *P, *G;
  float *M, *V;
  CK(cudaMalloc(&P, n * 2));
  CK(cudaMalloc(&G, n * 2));
  CK(cudaMalloc(&M, n * 4));
  CK(cudaMalloc(&V, n * 4));
  // random data: bf16 in roughly [-2, 2] (sign + exponent 0x3f.. / 0x40..), m random floats, v
  // positive
  auto fill = [&](void* d, int64_t bytes, uint32_t salt, uint32_t mask, uint32_t orv) {
    k_fill<<<1056, 512>>>((uint32_t*)d, bytes / 4, salt, mask, orv);
  };
  auto randomise = [&](bool bf16m) {
    fill(P, n * 2, 1, 0xBF7FBF7F, 0x3C003C00);
    fill(G, n * 2, 2, 0xBF7FBF7F, 0x38003800);
    if (bf16m) {
      fill(M, n * 2, 3, 0xBF7FBF7F, 0x38003800);
      fill(V, n * 2, 4, 0x3F7F3F7F, 0x30003000);
    } else {
      fill(M, n * 4, 3, 0xBF7FFFFF, 0x38000000);
      fill(V, n * 4, 4, 0x3F7FFFFF, 0x30000000);
    }
    cudaDeviceSynchronize();
  };
  S s{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1e-3f, 0.2f};
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("device %s, SMs %d, n = %lld elements\n", prop.name, prop.multiProcessorCount,
         (long long)n);
  auto report = [&](const char* name, float ms, double bpe) {
    const double tbs = bpe * n / (ms * 1e-3) / 1e12;
    printf("%-52s %8.3f ms  %6.3f TB/s  %5.1f%% of 4.8 TB/s\n", name, ms, tbs,
           100 * tbs * 1e12 / nominal);
  };
  const int it = 20;
  randomise(false);
#define LIB(NAME, SM, U, T, CH, MATH)                                                            \
  do {                                                                                           \
    const int64_t ch = CH;                                                                       \
    const unsigned blocks = unsigned((n + ch - 1) / ch);                                         \
    report(                                                                                      \
        NAME,                                                                                    \
        timeit([&] { k_lib<SM, U, T, MATH><<<blocks, T>>>(P, G, (SM*)M, (SM*)V, n, s, 7, ch); }, \
               it),                                                                              \
        sizeof(SM) == 4 ? 22 : 14);                                                              \
    CK(cudaGetLastError());                                                                      \
  } while (0)
  for (int rep = 0; rep < 2; ++rep) {
    printf("--- random data, fp32 moments (22 B/element), round %d\n", rep);
    LIB("lib x1 512 64k (main)", float, 1, 512, 65536, 0);
    LIB("lib x1 512 64k, fast div", float, 1, 512, 65536, 1);
    LIB("lib x1 512 64k, trivial math (memory + rng + SR)", float, 1, 512, 65536, 2);
    LIB("lib x2 512 16k, fast div", float, 2, 512, 16384, 1);
    LIB("lib x2 512 16k, trivial math", float, 2, 512, 16384, 2);
    LIB("lib x1 256 64k, fast div", float, 1, 256, 65536, 1);
  }
  for (int k = 0; k < 100; ++k)
    k_lib<float, 1, 512, 0><<<unsigned((n + 65535) / 65536), 512>>>(
        P, G, M, V, n, s, 7, 65536);  // ~0.4 s for nvidia-smi
  cudaDeviceSynchronize();
  randomise(true);
  printf("--- random data, bf16 moments (14 B/element)\n");
  LIB("lib bf16m x1 512 64k (main)", Bits, 1, 512, 65536, 0);
  LIB("lib bf16m x1 512 64k, fast div", Bits, 1, 512, 65536, 1);
  LIB("lib bf16m x1 512 64k, trivial math", Bits, 1, 512, 65536, 2);
  return 0;
}
