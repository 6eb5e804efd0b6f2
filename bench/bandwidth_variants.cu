// bench/bandwidth_variants.cu — variants of the two memory-bound kernels whose bandwidth issue 21
// sets at 85% of the H200's 4.8 TB/s: the stochastic-rounding AdamW update (kernels/stochastic.cu)
// and SiLU-mul's forward (kernels/silu_mul.cu), outside LibTorch, on large flat tensors with
// random data, timed with CUDA events over back-to-back launches. A bfloat16 copy gives the
// ceiling of the machine in the same run.
//
//   tools/gpu/bandwidth-variants [AdamW elements = 2^29] [rounds = 7]   # on the device
//
// The AdamW kernel's template parameters (22 bytes per element with float32 moments: read p, g, m,
// v; write p, m, v; 14 with bfloat16 moments):
//   VEC    elements per thread and step (4: 8-byte bfloat16 loads; 8: 16-byte loads everywhere)
//   RNG    0: one splitmix64 per element, sliced for p, m and v (the library's bits); 1: one per
//          four elements and stream, 16 bits each; 2: none (truncation), the upper bound of what
//          cheaper bits could give
//   FAST   fast divisions (__fdividef, a reciprocal multiply) instead of IEEE ones
//   GRID   0: one block per CHUNK elements; k > 0: k blocks per SM, grid-stride
// SiLU-mul forward (6 bytes per element: read gate and up, write h): threads per block, blocks per
// SM (0: one block per `threads` vectors of 16 bytes), FAST (__expf and __frcp_rn), UNROLL vectors
// per thread with every load issued first.
// Each list of variants runs interleaved rounds and prints medians: at the 700 W power cap an
// H200's figures drift by several points within a minute, so variants are compared under the same
// drift. Findings (docs/kernels.md): shorter AdamW blocks and the uncapped, fast-math SiLU-mul grid
// are in the library; the random bits and the divisions cost nothing measurable with float32
// moments.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

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
struct Scalars {
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
__device__ __forceinline__ float b2f(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ uint32_t sr(float v, uint32_t r) {
  uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7F800000U) == 0x7F800000U) {
    return (bits >> 16) | (((bits & 0x7FFFFF) != 0) ? 0x40 : 0);
  }
  bits += r & 0xFFFFU;
  return bits >> 16;
}
template <bool FAST>
__device__ __forceinline__ float adam(float p, float g, float& m, float& v, const Scalars& s) {
  p *= 1.0f - s.lr * s.wd;
  m = s.b1 * m + (1.0f - s.b1) * g;
  v = s.b2 * v + (1.0f - s.b2) * g * g;
  if constexpr (FAST) {
    const float denom = sqrtf(v) * (1.0f / s.bc2) + s.eps;
    return p - __fdividef(s.step_size * m, denom);
  } else {
    const float denom = sqrtf(v) / s.bc2 + s.eps;
    return p - s.step_size * m / denom;
  }
}

// VEC consecutive elements: bfloat16 as packed words, float32 as float4s.
template <int VEC>
__device__ __forceinline__ void load(const Bits* base, int64_t i, float (&o)[VEC]) {
  if constexpr (VEC == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(base + i);
    const uint32_t w[2] = {x.x, x.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      o[2 * k] = b2f(w[k] & 0xFFFF);
      o[2 * k + 1] = b2f(w[k] >> 16);
    }
  } else {
    const uint4 x = *reinterpret_cast<const uint4*>(base + i);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] = b2f(w[k] & 0xFFFF);
      o[2 * k + 1] = b2f(w[k] >> 16);
    }
  }
}
template <int VEC>
__device__ __forceinline__ void load(const float* base, int64_t i, float (&o)[VEC]) {
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    const float4 x = *reinterpret_cast<const float4*>(base + i + 4 * q);
    o[4 * q] = x.x;
    o[4 * q + 1] = x.y;
    o[4 * q + 2] = x.z;
    o[4 * q + 3] = x.w;
  }
}
template <int VEC>
__device__ __forceinline__ void store(Bits* base, int64_t i, const float (&o)[VEC],
                                      const uint32_t (&r)[VEC]) {
  uint32_t w[VEC / 2];
#pragma unroll
  for (int k = 0; k < VEC / 2; ++k) {
    w[k] = sr(o[2 * k], r[2 * k]) | (sr(o[2 * k + 1], r[2 * k + 1]) << 16);
  }
  if constexpr (VEC == 4) {
    *reinterpret_cast<uint2*>(base + i) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(base + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
template <int VEC>
__device__ __forceinline__ void store(float* base, int64_t i, const float (&o)[VEC],
                                      const uint32_t (&)[VEC]) {
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    *reinterpret_cast<float4*>(base + i + 4 * q) =
        make_float4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
  }
}

// Random bits of stream `stream` (0 p, 1 m, 2 v) for elements i .. i + VEC - 1 (i a multiple of 4).
template <int RNG, int VEC>
__device__ __forceinline__ void bits(uint64_t seed, int64_t i, int stream, uint32_t (&r)[VEC]) {
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    if constexpr (RNG == 1) {
      const uint64_t x = mix64(seed ^ (uint64_t(stream) << 38) ^ (uint64_t(i + 4 * q) >> 2));
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        r[4 * q + k] = uint32_t(x >> (16 * k));
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        r[4 * q + k] =
            RNG == 0 ? uint32_t(mix64(seed ^ uint64_t(i + 4 * q + k)) >> (16 * stream)) : 0U;
      }
    }
  }
}

template <class SM, int VEC, int THREADS, int RNG, bool FAST, int GRID, int64_t CHUNK = 65536>
__global__ void __launch_bounds__(THREADS)
    adamw_variant(Bits* __restrict__ P, const Bits* __restrict__ G, SM* __restrict__ M,
                  SM* __restrict__ V, int64_t n, Scalars s, uint64_t seed) {
  constexpr int64_t kChunk = CHUNK;
  int64_t first, end, stride;
  if constexpr (GRID == 0) {
    first = int64_t(blockIdx.x) * kChunk + VEC * int64_t(threadIdx.x);
    end = min(int64_t(blockIdx.x) * kChunk + kChunk, n);
    stride = VEC * int64_t(THREADS);
  } else {
    first = (int64_t(blockIdx.x) * THREADS + threadIdx.x) * VEC;
    end = n;
    stride = int64_t(gridDim.x) * THREADS * VEC;
  }
  for (int64_t i = first; i + VEC <= end; i += stride) {
    float p[VEC], g[VEC], m[VEC], v[VEC];
    load<VEC>(P, i, p);
    load<VEC>(G, i, g);
    load<VEC>(M, i, m);
    load<VEC>(V, i, v);
    uint32_t rp[VEC], rm[VEC], rv[VEC];
    if constexpr (RNG == 0) {  // one splitmix64 per element, sliced for p, m and v
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const uint64_t x = mix64(seed ^ uint64_t(i + k));
        rp[k] = uint32_t(x);
        rm[k] = uint32_t(x >> 16);
        rv[k] = uint32_t(x >> 32);
      }
    } else {
      bits<RNG, VEC>(seed, i, 0, rp);
      if constexpr (sizeof(SM) == 2) {
        bits<RNG, VEC>(seed, i, 1, rm);
        bits<RNG, VEC>(seed, i, 2, rv);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      p[k] = adam<FAST>(p[k], g[k], m[k], v[k], s);
    }
    store<VEC>(P, i, p, rp);
    if constexpr (sizeof(SM) == 2) {
      store<VEC>(M, i, m, rm);
      store<VEC>(V, i, v, rv);
    } else {
      store<VEC>(M, i, m, rp);
      store<VEC>(V, i, v, rp);
    }
  }
}

template <int THREADS, int UNROLL, bool FAST>
__global__ void __launch_bounds__(THREADS)
    silu_variant(const uint4* __restrict__ gate, const uint4* __restrict__ up,
                 uint4* __restrict__ out, int64_t vectors) {
  const int64_t stride = int64_t(gridDim.x) * THREADS;
  for (int64_t v0 = int64_t(blockIdx.x) * THREADS + threadIdx.x; v0 < vectors;
       v0 += stride * UNROLL) {
    uint4 g[UNROLL], u[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t v = v0 + k * stride;
      if (v < vectors) {
        g[k] = gate[v];
        u[k] = up[v];
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t v = v0 + k * stride;
      if (v >= vectors) {
        continue;
      }
      const uint32_t gw[4] = {g[k].x, g[k].y, g[k].z, g[k].w};
      const uint32_t uw[4] = {u[k].x, u[k].y, u[k].z, u[k].w};
      uint32_t hw[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float h[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float x = b2f(half == 0 ? gw[w] & 0xFFFF : gw[w] >> 16);
          const float y = b2f(half == 0 ? uw[w] & 0xFFFF : uw[w] >> 16);
          const float sig = FAST ? __frcp_rn(1.0f + __expf(-x)) : 1.0f / (1.0f + expf(-x));
          h[half] = x * sig * y;
        }
        // round to nearest even, as static_cast<bfloat16> does (finite inputs here)
        uint32_t out_bits[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t b = __float_as_uint(h[half]);
          out_bits[half] = (b + 0x7FFFU + ((b >> 16) & 1U)) >> 16;
        }
        hw[w] = out_bits[0] | (out_bits[1] << 16);
      }
      out[v] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    }
  }
}

__global__ void copy_bf16(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t vectors) {
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += int64_t(gridDim.x) * blockDim.x) {
    out[v] = in[v];
  }
}

// bfloat16 bits (or float32 words) from a hash: sign, an exponent in a band, random mantissa.
__global__ void fill(uint32_t* d, int64_t words, uint32_t salt, uint32_t mask, uint32_t orv) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x) {
    d[i] = (mix32(uint32_t(i) ^ mix32(salt)) & mask) | orv;
  }
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
  for (int i = 0; i < iters; ++i) {
    f();
  }
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : (int64_t(512) << 20);  // AdamW elements
  const int rounds = argc > 2 ? atoi(argv[2]) : 7;
  const double nominal = 4.8e12;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("device %s, SMs %d, AdamW n = %lld elements\n", prop.name, sms, (long long)n);
  Bits *P, *G;
  float *M, *V;
  CK(cudaMalloc(&P, n * 2));
  CK(cudaMalloc(&G, n * 2));
  CK(cudaMalloc(&M, n * 4));
  CK(cudaMalloc(&V, n * 4));
  auto fill_words = [&](void* d, int64_t bytes, uint32_t salt, uint32_t mask, uint32_t orv) {
    fill<<<sms * 8, 512>>>(static_cast<uint32_t*>(d), bytes / 4, salt, mask, orv);
  };
  // p ~ ±[2^-8, 2^0), g ~ ±[2^-15, 2^-7), m ~ ±g, v ~ [2^-30, 2^-14): values of a real step.
  auto randomise = [&](bool bf16_moments) {
    fill_words(P, n * 2, 1, 0x83FF83FF, 0x3B803B80);
    fill_words(G, n * 2, 2, 0x83FF83FF, 0x38003800);
    if (bf16_moments) {
      fill_words(M, n * 2, 3, 0x83FF83FF, 0x38003800);
      fill_words(V, n * 2, 4, 0x03FF03FF, 0x30803080);
    } else {
      fill_words(M, n * 4, 3, 0x83FFFFFF, 0x38000000);
      fill_words(V, n * 4, 4, 0x03FFFFFF, 0x30800000);
    }
    cudaDeviceSynchronize();
  };
  const Scalars s{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1e-3f, 0.2f};
  auto report = [&](const char* name, float ms, double bytes) {
    const double tbs = bytes / (ms * 1e-3) / 1e12;
    printf("%-58s %8.3f ms  %6.3f TB/s  %5.1f%% of 4.8 TB/s\n", name, ms, tbs,
           100 * tbs * 1e12 / nominal);
    fflush(stdout);
  };
  const int it = 20;
  // Each list runs `rounds` times interleaved (A B C ... A B C ...), so every variant sees the same
  // mix of power states; the median of its rounds is printed after the list.
  struct Variant {
    const char* name;
    double bytes;
    std::function<void()> launch;
  };
  auto run_list = [&](const char* title, const std::vector<Variant>& list) {
    printf("--- %s: median of %d interleaved rounds of %d launches\n", title, rounds, it);
    std::vector<std::vector<float>> ms(list.size());
    for (int r = 0; r < rounds; ++r) {
      for (std::size_t v = 0; v < list.size(); ++v) {
        ms[v].push_back(timeit(list[v].launch, it));
      }
    }
    for (std::size_t v = 0; v < list.size(); ++v) {
      std::sort(ms[v].begin(), ms[v].end());
      report(list[v].name, ms[v][ms[v].size() / 2], list[v].bytes);
      printf("%58s min %.3f max %.3f ms\n", "", ms[v].front(), ms[v].back());
    }
  };
  const auto blocks_of = [&](int64_t span) { return unsigned((n + span - 1) / span); };
  const double b22 = 22.0 * n;
  const double b14 = 14.0 * n;
  const int64_t copy_vectors = n * 2 / 16;
  const Variant copy_uncapped{"copy bf16 (read 2n B, write 2n B), uncapped", 4.0 * n, [&] {
                                copy_bf16<<<unsigned((copy_vectors + 255) / 256), 256>>>(
                                    reinterpret_cast<const uint4*>(P), reinterpret_cast<uint4*>(V),
                                    copy_vectors);
                              }};
  randomise(false);
  run_list("AdamW, bf16 p and g, fp32 moments (22 B/element)",
           {copy_uncapped,
            {"vec4 512 chunk64k (library before)", b22,
             [&] {
               adamw_variant<float, 4, 512, 0, false, 0, 65536>
                   <<<blocks_of(65536), 512>>>(P, G, M, V, n, s, 7);
             }},
            {"vec4 256 chunk1k", b22,
             [&] {
               adamw_variant<float, 4, 256, 0, false, 0, 1024>
                   <<<blocks_of(1024), 256>>>(P, G, M, V, n, s, 7);
             }},
            {"vec4 128 chunk512", b22,
             [&] {
               adamw_variant<float, 4, 128, 0, false, 0, 512>
                   <<<blocks_of(512), 128>>>(P, G, M, V, n, s, 7);
             }},
            {"vec4 512 chunk2k", b22,
             [&] {
               adamw_variant<float, 4, 512, 0, false, 0, 2048>
                   <<<blocks_of(2048), 512>>>(P, G, M, V, n, s, 7);
             }},
            {"vec4 256 chunk2k (two groups per thread)", b22, [&] {
               adamw_variant<float, 4, 256, 0, false, 0, 2048>
                   <<<blocks_of(2048), 256>>>(P, G, M, V, n, s, 7);
             }}});
  randomise(true);
  run_list("AdamW, bf16 moments (14 B/element)",
           {{"bf16m vec4 512 chunk64k (library)", b14,
             [&] {
               adamw_variant<Bits, 4, 512, 0, false, 0, 65536>
                   <<<blocks_of(65536), 512>>>(P, G, (Bits*)M, (Bits*)V, n, s, 7);
             }},
            {"bf16m vec4 256 chunk1k", b14, [&] {
               adamw_variant<Bits, 4, 256, 0, false, 0, 1024>
                   <<<blocks_of(1024), 256>>>(P, G, (Bits*)M, (Bits*)V, n, s, 7);
             }}});
  // SiLU-mul forward on [16384, 12288] bfloat16: gate in P's storage, up in M's, out in V's.
  const int64_t elements = int64_t(16384) * 12288;
  const int64_t vectors = elements / 8;
  fill_words(P, elements * 2, 11, 0x81FF81FF, 0x3E003E00);  // ±[2^-3, 2^2)
  fill_words(M, elements * 2, 12, 0x81FF81FF, 0x3E003E00);
  cudaDeviceSynchronize();
  const auto* gate = reinterpret_cast<const uint4*>(P);
  const auto* up = reinterpret_cast<const uint4*>(M);
  auto* out = reinterpret_cast<uint4*>(V);
  const auto silu_blocks = [&](int threads, int64_t per_sm) {
    const int64_t needed = (vectors + threads - 1) / threads;
    return unsigned(per_sm == 0 ? needed : std::min<int64_t>(needed, int64_t(sms) * per_sm));
  };
  const double b6 = 6.0 * elements;
  run_list(
      "SiLU-mul forward, 16384 x 12288 bf16 (6 B/element)",
      {{"256 cap32/SM ieee (library)", b6,
        [&] {
          silu_variant<256, 1, false><<<silu_blocks(256, 32), 256>>>(gate, up, out, vectors);
        }},
       {"256 cap32/SM fast", b6,
        [&] { silu_variant<256, 1, true><<<silu_blocks(256, 32), 256>>>(gate, up, out, vectors); }},
       {"256 cap64/SM fast", b6,
        [&] { silu_variant<256, 1, true><<<silu_blocks(256, 64), 256>>>(gate, up, out, vectors); }},
       {"256 uncapped fast", b6,
        [&] { silu_variant<256, 1, true><<<silu_blocks(256, 0), 256>>>(gate, up, out, vectors); }},
       {"256 uncapped ieee", b6,
        [&] { silu_variant<256, 1, false><<<silu_blocks(256, 0), 256>>>(gate, up, out, vectors); }},
       {"128 uncapped fast", b6, [&] {
          silu_variant<128, 1, true><<<silu_blocks(128, 0), 128>>>(gate, up, out, vectors);
        }}});
  CK(cudaGetLastError());
  return 0;
}
