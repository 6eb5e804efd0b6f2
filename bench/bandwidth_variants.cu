// bench/bandwidth_variants.cu — variants of the two memory-bound kernels whose bandwidth issue 21
// sets at 85% of the H200's 4.8 TB/s: the stochastic-rounding AdamW update (kernels/stochastic.cu)
// and SiLU-mul's forward (kernels/silu_mul.cu), outside LibTorch, on large flat tensors with
// random data, timed with CUDA events over back-to-back launches. A bfloat16 copy gives the
// ceiling of the machine in the same run.
//
//   tools/gpu/bandwidth-variants [AdamW elements = 2^29] [rounds = 7] [all | access]  # on device
//
// The AdamW element count is rounded down to a multiple of 65536. `access` runs only the first
// list (the access-pattern variants below, with their bitwise check); `all` (the default) runs it
// and then the older lists.
//
// Access-pattern variants of the float32-moment update (list "AdamW access patterns"): the same
// arithmetic and random bits as the library (one splitmix64 per element, keyed by the element's
// index), only the memory access changes. Before timing, each runs once on fresh random inputs of
// 2^22 elements and its p, m and v are compared bit for bit with the reference's ("match" or
// "MISMATCH <elements>"). Blocks per SM follow from the registers; the names give them where they
// differ from the reference's five.
//   vec4 256 span2k (reference)  the library's shape in adamw_variant: 256 threads, 2048 elements
//                                per block, four per thread and step, 8- and 16-byte loads
//   library kernel               kernels/stochastic.cu's kernel, slot and chunk table included
//   ldcs g, stcs p m v           streaming loads of the gradient (read once) and evict-first
//                                stores; "ldcs all, stcs all": every access streaming
//   6 / 8 blocks/SM              __launch_bounds__ caps the registers (40 / 32, the latter spills)
//   unroll2 loads first          both steps' loads issued before any arithmetic: twice the bytes
//                                in flight per thread
//   vec8                         eight elements per thread and step: 16-byte loads everywhere
//   grid-stride, persistent      k blocks per SM looping over the tensor; "double-buffered": the
//                                next step's loads issued before the current step's arithmetic
//   cp.async                     persistent; each thread copies its own elements into shared
//                                memory (cp.async 8 B for p and g, 16 B .cg for m and v) 2 or 3
//                                tiles of 2048 ahead, no barrier
//   bulk loads                   persistent; thread 0 loads whole tiles with cp.async.bulk (the
//                                TMA's 1-D copies) on an mbarrier per stage; "+stores": the
//                                results go back to shared memory and out by bulk copies too
//
// The older lists. The AdamW kernel's template parameters (22 bytes per element with float32
// moments: read p, g, m, v; write p, m, v; 14 with bfloat16 moments):
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
// moments. The copy writes to a buffer of its own (it used to write over the first half of v, which
// turned a quarter of the later updates into NaN).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
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

// VEC consecutive elements: bfloat16 as packed words, float32 as float4s. CS: streaming accesses
// (__ldcs / __stcs: ld.global.cs, st.global.cs, evict-first in L1 and L2).
template <bool CS, class T>
__device__ __forceinline__ T ld(const T* a) {
  if constexpr (CS) {
    return __ldcs(a);
  } else {
    return *a;
  }
}
template <bool CS, class T>
__device__ __forceinline__ void st(T* a, const T& x) {
  if constexpr (CS) {
    __stcs(a, x);
  } else {
    *a = x;
  }
}
template <int VEC, bool CS = false>
__device__ __forceinline__ void load(const Bits* base, int64_t i, float (&o)[VEC]) {
  if constexpr (VEC == 4) {
    const uint2 x = ld<CS>(reinterpret_cast<const uint2*>(base + i));
    const uint32_t w[2] = {x.x, x.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      o[2 * k] = b2f(w[k] & 0xFFFF);
      o[2 * k + 1] = b2f(w[k] >> 16);
    }
  } else {
    const uint4 x = ld<CS>(reinterpret_cast<const uint4*>(base + i));
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] = b2f(w[k] & 0xFFFF);
      o[2 * k + 1] = b2f(w[k] >> 16);
    }
  }
}
template <int VEC, bool CS = false>
__device__ __forceinline__ void load(const float* base, int64_t i, float (&o)[VEC]) {
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    const float4 x = ld<CS>(reinterpret_cast<const float4*>(base + i + 4 * q));
    o[4 * q] = x.x;
    o[4 * q + 1] = x.y;
    o[4 * q + 2] = x.z;
    o[4 * q + 3] = x.w;
  }
}
template <int VEC, bool CS = false>
__device__ __forceinline__ void store(Bits* base, int64_t i, const float (&o)[VEC],
                                      const uint32_t (&r)[VEC]) {
  uint32_t w[VEC / 2];
#pragma unroll
  for (int k = 0; k < VEC / 2; ++k) {
    w[k] = sr(o[2 * k], r[2 * k]) | (sr(o[2 * k + 1], r[2 * k + 1]) << 16);
  }
  if constexpr (VEC == 4) {
    st<CS>(reinterpret_cast<uint2*>(base + i), make_uint2(w[0], w[1]));
  } else {
    st<CS>(reinterpret_cast<uint4*>(base + i), make_uint4(w[0], w[1], w[2], w[3]));
  }
}
template <int VEC, bool CS = false>
__device__ __forceinline__ void store(float* base, int64_t i, const float (&o)[VEC],
                                      const uint32_t (&)[VEC]) {
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    st<CS>(reinterpret_cast<float4*>(base + i + 4 * q),
           make_float4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]));
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

// --- Access-pattern variants of the float32-moment update (list "access") ---
// Every one computes what the library's kernel computes, bit for bit: adam<false> is
// detail::adamw_element, the random bits of element i are the low 16 bits of mix64(seed ^ i) (the
// library's random_bits for tensor 0, keyed by the element index and not by the thread), and only
// p is rounded. They differ in cache hints, the launch shape and how loads are kept in flight. All
// assume n is a multiple of 65536 (main rounds n down).

// The library's kernel as it is (kernels/stochastic.cu, bfloat16 gradients, float32 moments,
// vectorised): a table of slots and chunks, 32 blocks of 256 threads and 2048 elements per
// 65536-element chunk, the scalar tail, no launch bounds.
struct LibSlot {
  Bits* p;
  const void* g;
  void* m;
  void* v;
  int64_t n;
  int64_t index;
};
__global__ void adamw_library(const LibSlot* __restrict__ slots, const int64_t* __restrict__ chunks,
                              Scalars s, uint64_t seed) {
  constexpr int64_t kChunk = 65536;
  constexpr int64_t kSpan = 2048;
  constexpr int64_t kPerChunk = kChunk / kSpan;
  const int64_t chunk = blockIdx.x / kPerChunk;
  const LibSlot slot = slots[chunks[2 * chunk]];
  const int64_t start = chunks[2 * chunk + 1] + (blockIdx.x % kPerChunk) * kSpan;
  const int64_t end = min(start + kSpan, slot.n);
  const auto* g = static_cast<const Bits*>(slot.g);
  auto* m = static_cast<float*>(slot.m);
  auto* v = static_cast<float*>(slot.v);
  const auto tensor = uint64_t(slot.index);
  for (int64_t i = start + 4 * int64_t(threadIdx.x); i < end; i += 4 * int64_t(blockDim.x)) {
    if (i + 4 > end) {
      for (int64_t k = i; k < end; ++k) {
        const uint64_t r = mix64(seed ^ (tensor << 40) ^ uint64_t(k));
        float mv = m[k];
        float vv = v[k];
        const float p = adam<false>(b2f(slot.p[k]), b2f(g[k]), mv, vv, s);
        slot.p[k] = Bits(sr(p, uint32_t(r)));
        m[k] = mv;
        v[k] = vv;
      }
      continue;
    }
    float p[4], gv[4], mv[4], vv[4];
    load<4>(slot.p, i, p);
    load<4>(g, i, gv);
    load<4>(m, i, mv);
    load<4>(v, i, vv);
    uint32_t rp[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      rp[k] = uint32_t(mix64(seed ^ (tensor << 40) ^ uint64_t(i + k)));
      p[k] = adam<false>(p[k], gv[k], mv[k], vv[k], s);
    }
    store<4>(slot.p, i, p, rp);
    store<4>(m, i, mv, rp);
    store<4>(v, i, vv, rp);
  }
}

// One thread's VEC consecutive elements in registers. HINT 0: plain loads and stores; 1: __ldcs
// for g (read once), __stcs for p, m and v; 2: __ldcs for every load, __stcs for every store.
template <int VEC>
struct Regs {
  float p[VEC], g[VEC], m[VEC], v[VEC];
};
template <int VEC, int HINT>
__device__ __forceinline__ void fetch(const Bits* P, const Bits* G, const float* M, const float* V,
                                      int64_t i, Regs<VEC>& x) {
  load<VEC, HINT == 2>(P, i, x.p);
  load<VEC, HINT >= 1>(G, i, x.g);
  load<VEC, HINT == 2>(M, i, x.m);
  load<VEC, HINT == 2>(V, i, x.v);
}
// The update of x (elements i .. i + VEC - 1) in place; rp: the random bits of p.
template <int VEC>
__device__ __forceinline__ void compute(int64_t i, Regs<VEC>& x, uint32_t (&rp)[VEC],
                                        const Scalars& s, uint64_t seed) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    rp[k] = uint32_t(mix64(seed ^ uint64_t(i + k)));
    x.p[k] = adam<false>(x.p[k], x.g[k], x.m[k], x.v[k], s);
  }
}
template <int VEC, int HINT>
__device__ __forceinline__ void update(Bits* P, float* M, float* V, int64_t i, Regs<VEC>& x,
                                       const Scalars& s, uint64_t seed) {
  uint32_t rp[VEC];
  compute<VEC>(i, x, rp, s, seed);
  store<VEC, HINT >= 1>(P, i, x.p, rp);
  store<VEC, HINT >= 1>(M, i, x.m, rp);
  store<VEC, HINT >= 1>(V, i, x.v, rp);
}

// One block per SPAN elements, VEC per thread and step. UNROLL steps at a time: all their loads
// first, then the arithmetic and the stores, so a thread has UNROLL times the bytes in flight. The
// loop over steps is not unrolled further, as the library's loop with its run-time bound is not.
// MINB > 1: __launch_bounds__(THREADS, MINB), registers capped so that MINB blocks fit on an SM
// (adamw_variant in the library's shape takes 46 registers, five blocks of 256; adamw_library 40).
template <int VEC, int THREADS, int64_t SPAN, int HINT, int UNROLL, int MINB = 1>
__global__ void __launch_bounds__(THREADS, MINB)
    sr_blocked(Bits* __restrict__ P, const Bits* __restrict__ G, float* __restrict__ M,
               float* __restrict__ V, Scalars s, uint64_t seed) {
  constexpr int64_t kStep = int64_t(VEC) * THREADS;
  static_assert(SPAN % (kStep * UNROLL) == 0);
  const int64_t first = int64_t(blockIdx.x) * SPAN + VEC * int64_t(threadIdx.x);
#pragma unroll 1
  for (int64_t i = first; i < int64_t(blockIdx.x) * SPAN + SPAN; i += kStep * UNROLL) {
    Regs<VEC> x[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      fetch<VEC, HINT>(P, G, M, V, i + u * kStep, x[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      update<VEC, HINT>(P, M, V, i + u * kStep, x[u], s, seed);
    }
  }
}

// A persistent grid (k blocks per SM, grid-stride) with register double buffering: the loads of a
// thread's next step are issued before the arithmetic of the current one.
template <int VEC, int THREADS, int HINT, int MINB = 1>
__global__ void __launch_bounds__(THREADS, MINB)
    sr_persistent(Bits* __restrict__ P, const Bits* __restrict__ G, float* __restrict__ M,
                  float* __restrict__ V, int64_t n, Scalars s, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * THREADS * VEC;
  int64_t i = (int64_t(blockIdx.x) * THREADS + threadIdx.x) * VEC;
  if (i >= n) {
    return;
  }
  Regs<VEC> cur;
  fetch<VEC, HINT>(P, G, M, V, i, cur);
  for (;;) {
    const int64_t next = i + stride;
    Regs<VEC> nxt;
    if (next < n) {
      fetch<VEC, HINT>(P, G, M, V, next, nxt);
    }
    update<VEC, HINT>(P, M, V, i, cur, s, seed);
    if (next >= n) {
      break;
    }
    i = next;
    cur = nxt;  // a loop-carried value: renamed registers, not copies
  }
}

// Shared-memory staging. A stage holds one tile of TILE elements as p [TILE] bf16, g [TILE] bf16,
// m [TILE] float32, v [TILE] float32 (12 * TILE bytes); the tiles of the persistent grid's block b
// are b, b + grid, b + 2 grid, ...
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes) {
  // bytes 8: through L1 (.ca; .cg takes only 16); 16: L2 only (.cg)
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// One thread's four elements at q (element 4q of the tile) from a stage.
__device__ __forceinline__ void from_stage(const unsigned char* stage, int tile, int q,
                                           Regs<4>& x) {
  const auto* sp = reinterpret_cast<const Bits*>(stage);
  const auto* sg = sp + tile;
  const auto* sm = reinterpret_cast<const float*>(stage + 4 * tile);
  const auto* sv = sm + tile;
  load<4>(sp, 4 * q, x.p);
  load<4>(sg, 4 * q, x.g);
  load<4>(sm, 4 * q, x.m);
  load<4>(sv, 4 * q, x.v);
}

// cp.async (Ampere's asynchronous copies, 8 bytes for p and g, 16 for m and v), STAGES tiles per
// block in flight. Each thread copies and then reads only its own elements (the library's mapping:
// groups of four at 4 tid, 4 (tid + THREADS), ...), so cp.async.wait_group alone orders the copies
// before the reads, with no barrier.
template <int THREADS, int TILE, int STAGES>
__global__ void __launch_bounds__(THREADS)
    sr_cp_async(Bits* __restrict__ P, const Bits* __restrict__ G, float* __restrict__ M,
                float* __restrict__ V, int64_t n, Scalars s, uint64_t seed) {
  static_assert(TILE % (4 * THREADS) == 0 && STAGES >= 2);
  constexpr int kGroups = TILE / (4 * THREADS);
  constexpr int kBytes = 12 * TILE;
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t tiles = n / TILE;
  const auto issue = [&](int64_t j) {  // this block's tile j into stage j % STAGES
    const int64_t tile = blockIdx.x + j * gridDim.x;
    if (tile < tiles) {
      unsigned char* stage = smem + (j % STAGES) * kBytes;
      auto* sp = reinterpret_cast<Bits*>(stage);
      auto* sg = sp + TILE;
      auto* sm = reinterpret_cast<float*>(stage + 4 * TILE);
      auto* sv = sm + TILE;
      const int64_t e = tile * TILE;
#pragma unroll
      for (int u = 0; u < kGroups; ++u) {
        const int q = threadIdx.x + u * THREADS;
        cp_async(sp + 4 * q, P + e + 4 * q, 8);
        cp_async(sg + 4 * q, G + e + 4 * q, 8);
        cp_async(sm + 4 * q, M + e + 4 * q, 16);
        cp_async(sv + 4 * q, V + e + 4 * q, 16);
      }
    }
    cp_async_commit();  // empty groups too: one group per j keeps the count of pending groups
  };
  for (int j = 0; j < STAGES - 1; ++j) {
    issue(j);
  }
  for (int64_t j = 0; blockIdx.x + j * gridDim.x < tiles; ++j) {
    // stage (j - 1) % STAGES was read by this thread in step j - 1, its values consumed already
    issue(j + STAGES - 1);
    cp_async_wait<STAGES - 1>();  // tile j has landed
    const unsigned char* stage = smem + (j % STAGES) * kBytes;
    const int64_t e = (blockIdx.x + j * gridDim.x) * TILE;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int q = threadIdx.x + u * THREADS;
      Regs<4> x;
      from_stage(stage, TILE, q, x);
      update<4, 0>(P, M, V, e + 4 * q, x, s, seed);
    }
  }
  cp_async_wait<0>();  // no copy into shared memory outlives the block
}

// Bulk copies (the TMA's 1-D form, cp.async.bulk) completing on one mbarrier per stage: thread 0
// loads a whole tile (four copies of 2 TILE to 4 TILE bytes) STAGES tiles ahead; every thread
// waits for the stage's phase, updates its groups (the library's mapping) and either stores them
// to global memory itself (BULK_STORE false) or writes them back into the stage, which thread 0
// then stores with three bulk copies (true). A barrier per tile frees the stage for the next load.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(
                   __cvta_generic_to_global(dst)),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
}

template <int THREADS, int TILE, int STAGES, bool BULK_STORE>
__global__ void __launch_bounds__(THREADS)
    sr_bulk(Bits* __restrict__ P, const Bits* __restrict__ G, float* __restrict__ M,
            float* __restrict__ V, int64_t n, Scalars s, uint64_t seed) {
  static_assert(TILE % (4 * THREADS) == 0 && TILE % 8 == 0 && STAGES >= 2);
  constexpr int kGroups = TILE / (4 * THREADS);
  constexpr int kBytes = 12 * TILE;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[STAGES];
  const int64_t tiles = n / TILE;
  const auto stage_of = [&](int64_t j) { return smem + (j % STAGES) * kBytes; };
  const auto load_tile = [&](int64_t j) {  // thread 0: this block's tile j into its stage
    const int64_t tile = blockIdx.x + j * gridDim.x;
    if (tile < tiles) {
      unsigned char* stage = stage_of(j);
      uint64_t* bar = &full[j % STAGES];
      const int64_t e = tile * TILE;
      mbar_expect_tx(bar, kBytes);
      bulk_load(stage, P + e, 2 * TILE, bar);
      bulk_load(stage + 2 * TILE, G + e, 2 * TILE, bar);
      bulk_load(stage + 4 * TILE, M + e, 4 * TILE, bar);
      bulk_load(stage + 8 * TILE, V + e, 4 * TILE, bar);
    }
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < STAGES; ++k) {
      mbar_init(&full[k], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_proxy_async();
    // with bulk stores a stage is reloaded one step late (below), so one tile fewer ahead
    for (int j = 0; j < (BULK_STORE ? STAGES - 1 : STAGES); ++j) {
      load_tile(j);
    }
  }
  __syncthreads();
  for (int64_t j = 0; blockIdx.x + j * gridDim.x < tiles; ++j) {
    mbar_wait(&full[j % STAGES], uint32_t(j / STAGES) & 1U);
    unsigned char* stage = stage_of(j);
    const int64_t e = (blockIdx.x + j * gridDim.x) * TILE;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int q = threadIdx.x + u * THREADS;
      Regs<4> x;
      from_stage(stage, TILE, q, x);
      if constexpr (BULK_STORE) {
        uint32_t rp[4];
        compute<4>(e + 4 * q, x, rp, s, seed);
        store<4>(reinterpret_cast<Bits*>(stage), 4 * q, x.p, rp);
        store<4>(reinterpret_cast<float*>(stage + 4 * TILE), 4 * q, x.m, rp);
        store<4>(reinterpret_cast<float*>(stage + 8 * TILE), 4 * q, x.v, rp);
      } else {
        update<4, 0>(P, M, V, e + 4 * q, x, s, seed);
      }
    }
    if constexpr (BULK_STORE) {
      fence_proxy_async();  // this thread's writes to the stage, before the bulk copies read it
    }
    __syncthreads();  // every thread is done with stage j (and, with bulk stores, wrote it)
    if (threadIdx.x == 0) {
      if constexpr (BULK_STORE) {
        bulk_store(P + e, stage, 2 * TILE);
        bulk_store(M + e, stage + 4 * TILE, 4 * TILE);
        bulk_store(V + e, stage + 8 * TILE, 4 * TILE);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // the stores of tile j - 1 have read their stage, which now takes tile j - 1 + STAGES
        bulk_wait_read<1>();
        load_tile(j + STAGES - 1);
      } else {
        load_tile(j + STAGES);
      }
    }
  }
  if constexpr (BULK_STORE) {
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
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

// Buffers of one AdamW problem, with the library kernel's table for them.
struct Buffers {
  Bits* p;
  Bits* g;
  float* m;
  float* v;
  int64_t n;
  const LibSlot* slots;
  const int64_t* chunks;
};

// Blocks per SM that fit of `kernel` (after its dynamic shared memory is allowed).
template <class K>
int resident(K kernel, int threads, int smem) {
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem);
  return blocks;
}

int main(int argc, char** argv) {
  // AdamW elements, rounded down to a multiple of 65536 (the library's chunk; every variant's tile
  // divides it)
  const int64_t n = (argc > 1 ? atoll(argv[1]) : (int64_t(512) << 20)) / 65536 * 65536;
  const int rounds = argc > 2 ? atoi(argv[2]) : 7;
  const std::string lists = argc > 3 ? argv[3] : "all";
  if (n <= 0 || rounds <= 0 || (lists != "all" && lists != "access")) {
    printf("usage: %s [AdamW elements >= 65536] [rounds] [all | access]\n", argv[0]);
    return 1;
  }
  const double nominal = 4.8e12;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("device %s, SMs %d, AdamW n = %lld elements\n", prop.name, sms, (long long)n);
  Bits *P, *G, *C;
  float *M, *V;
  CK(cudaMalloc(&P, n * 2));
  CK(cudaMalloc(&G, n * 2));
  CK(cudaMalloc(&M, n * 4));
  CK(cudaMalloc(&V, n * 4));
  CK(cudaMalloc(&C, n * 2));  // the copy's output (it wrote over V before, NaN for the updates)
  auto fill_words = [&](void* d, int64_t bytes, uint32_t salt, uint32_t mask, uint32_t orv) {
    fill<<<sms * 8, 512>>>(static_cast<uint32_t*>(d), bytes / 4, salt, mask, orv);
  };
  // p ~ ±[2^-8, 2^0), g ~ ±[2^-15, 2^-7), m ~ ±g, v ~ [2^-30, 2^-14): values of a real step.
  auto randomise_at = [&](Bits* p, Bits* g, void* m, void* v, int64_t count, bool bf16_moments) {
    fill_words(p, count * 2, 1, 0x83FF83FF, 0x3B803B80);
    fill_words(g, count * 2, 2, 0x83FF83FF, 0x38003800);
    if (bf16_moments) {
      fill_words(m, count * 2, 3, 0x83FF83FF, 0x38003800);
      fill_words(v, count * 2, 4, 0x03FF03FF, 0x30803080);
    } else {
      fill_words(m, count * 4, 3, 0x83FFFFFF, 0x38000000);
      fill_words(v, count * 4, 4, 0x03FFFFFF, 0x30800000);
    }
    cudaDeviceSynchronize();
  };
  auto randomise = [&](bool bf16_moments) { randomise_at(P, G, M, V, n, bf16_moments); };
  const Scalars s{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1e-3f, 0.2f};
  auto report = [&](const std::string& name, float ms, double bytes) {
    const double tbs = bytes / (ms * 1e-3) / 1e12;
    printf("%-58s %8.3f ms  %6.3f TB/s  %5.1f%% of 4.8 TB/s\n", name.c_str(), ms, tbs,
           100 * tbs * 1e12 / nominal);
    fflush(stdout);
  };
  const int it = 20;
  // Each list runs `rounds` times interleaved (A B C ... A B C ...), so every variant sees the same
  // mix of power states; the median of its rounds is printed after the list.
  struct Variant {
    std::string name;
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
    // a list that starts with the copy also gives each variant's bytes per second as a share of
    // the copy's, comparable between cards of other nominal bandwidths (an H100's 3.35 TB/s)
    const bool vs_copy = list[0].name.rfind("copy", 0) == 0;
    double copy_rate = 0;
    for (std::size_t v = 0; v < list.size(); ++v) {
      std::sort(ms[v].begin(), ms[v].end());
      const float median = ms[v][ms[v].size() / 2];
      report(list[v].name, median, list[v].bytes);
      const double rate = list[v].bytes / median;
      copy_rate = v == 0 ? rate : copy_rate;
      printf("%58s min %.3f max %.3f ms", "", ms[v].front(), ms[v].back());
      if (vs_copy) {
        printf("  %5.1f%% of the copy", 100 * rate / copy_rate);
      }
      printf("\n");
    }
  };
  const auto blocks_of = [&](int64_t span) { return unsigned((n + span - 1) / span); };
  const double b22 = 22.0 * n;
  const double b14 = 14.0 * n;
  const int64_t copy_vectors = n * 2 / 16;
  const Variant copy_uncapped{"copy bf16 (read 2n B, write 2n B), uncapped", 4.0 * n, [&] {
                                copy_bf16<<<unsigned((copy_vectors + 255) / 256), 256>>>(
                                    reinterpret_cast<const uint4*>(P), reinterpret_cast<uint4*>(C),
                                    copy_vectors);
                              }};

  // Access-pattern variants of the float32-moment update, each a launch on any Buffers.
  struct SrVariant {
    std::string name;
    std::function<void(const Buffers&)> launch;
  };
  std::vector<SrVariant> access;
  // The library's shape in this file's template: the reference of the bitwise check.
  access.push_back({"vec4 256 span2k (library shape; reference)", [&](const Buffers& b) {
                      adamw_variant<float, 4, 256, 0, false, 0, 2048>
                          <<<unsigned(b.n / 2048), 256>>>(b.p, b.g, b.m, b.v, b.n, s, 7);
                    }});
  access.push_back({"library kernel (slot table, no launch bounds)", [&](const Buffers& b) {
                      adamw_library<<<unsigned(b.n / 2048), 256>>>(b.slots, b.chunks, s, 7);
                    }});
  const auto blocked = [&](const char* name, auto kernel, int threads, int64_t span) {
    access.push_back({name, [=, &s](const Buffers& b) {
                        kernel<<<unsigned(b.n / span), threads>>>(b.p, b.g, b.m, b.v, s, 7);
                      }});
  };
  // Registers decide the blocks per SM (256 threads: 5 blocks up to 48 registers, 6 up to 40,
  // 8 up to 32); the comments give them, the names say when a variant differs from the reference.
  blocked("vec4 256 span2k (control of the hints)", sr_blocked<4, 256, 2048, 0, 1>, 256,
          2048);  // 48 registers, 5 blocks/SM like the reference (46)
  blocked("vec4 256 span2k ldcs g, stcs p m v", sr_blocked<4, 256, 2048, 1, 1, 5>, 256, 2048);
  blocked("vec4 256 span2k ldcs all, stcs all", sr_blocked<4, 256, 2048, 2, 1, 5>, 256, 2048);
  blocked("vec4 256 span2k 6 blocks/SM (<= 40 regs)", sr_blocked<4, 256, 2048, 0, 1, 6>, 256,
          2048);  // the library's own kernel compiles to 40 registers
  blocked("vec4 256 span2k 6 blocks/SM ldcs g, stcs p m v", sr_blocked<4, 256, 2048, 1, 1, 6>, 256,
          2048);
  blocked("vec4 256 span2k 6 blocks/SM ldcs all, stcs all", sr_blocked<4, 256, 2048, 2, 1, 6>, 256,
          2048);
  blocked("vec4 256 span2k 8 blocks/SM (32 regs, 32 B spill)", sr_blocked<4, 256, 2048, 0, 1, 8>,
          256, 2048);
  blocked("vec4 256 span2k unroll2 loads first", sr_blocked<4, 256, 2048, 0, 2, 5>, 256, 2048);
  blocked("vec4 256 span2k unroll2 loads first, ldcs g, stcs", sr_blocked<4, 256, 2048, 1, 2, 5>,
          256, 2048);
  blocked("vec4 256 span4k unroll2 loads first", sr_blocked<4, 256, 4096, 0, 2, 5>, 256, 4096);
  blocked("vec4 512 span4k unroll2 loads first", sr_blocked<4, 512, 4096, 0, 2, 2>, 512,
          4096);  // 64 registers at most: two blocks of 512, like four of 256
  // vec8: 60-64 registers, 4 blocks/SM; with unroll2 3 (72 registers)
  blocked("vec8 256 span2k 4 blocks/SM", sr_blocked<8, 256, 2048, 0, 1>, 256, 2048);
  blocked("vec8 256 span2k 4 blocks/SM ldcs g, stcs p m v", sr_blocked<8, 256, 2048, 1, 1>, 256,
          2048);
  blocked("vec8 256 span4k 4 blocks/SM", sr_blocked<8, 256, 4096, 0, 1>, 256, 4096);
  blocked("vec8 256 span4k unroll2 loads first 3 blocks/SM", sr_blocked<8, 256, 4096, 0, 2, 3>, 256,
          4096);
  // Persistent grids: `per_sm` blocks per SM asked for, as many as fit launched (in the name).
  const auto persistent = [&](const char* what, auto kernel, int threads, int smem, int per_sm) {
    const int fit = std::min(resident(kernel, threads, smem), per_sm);
    char name[96];
    snprintf(name, sizeof name, "%s %d/SM%s", what, fit, fit < per_sm ? " (fewer fit)" : "");
    const unsigned grid = unsigned(sms * std::max(fit, 1));
    access.push_back({name, [=, &s](const Buffers& b) {
                        kernel<<<grid, threads, smem>>>(b.p, b.g, b.m, b.v, b.n, s, 7);
                      }});
  };
  persistent("grid-stride vec4 256, no double buffering", adamw_variant<float, 4, 256, 0, false, 1>,
             256, 0, 5);
  persistent("persistent vec4 256 double-buffered", sr_persistent<4, 256, 0, 4>, 256, 0, 4);
  persistent("persistent vec4 256 double-buffered", sr_persistent<4, 256, 0, 5>, 256, 0, 5);
  persistent("persistent vec4 256 dbuf, ldcs g, stcs", sr_persistent<4, 256, 1, 5>, 256, 0, 5);
  persistent("persistent vec8 256 double-buffered", sr_persistent<8, 256, 0, 3>, 256, 0, 3);
  // Shared-memory stages of 24 KiB (tile2k) or 48 KiB (tile4k); the names give the blocks per SM.
  persistent("cp.async 256 tile2k 3 stages", sr_cp_async<256, 2048, 3>, 256, 3 * 12 * 2048, 2);
  persistent("cp.async 256 tile2k 4 stages", sr_cp_async<256, 2048, 4>, 256, 4 * 12 * 2048, 2);
  persistent("bulk loads 256 tile2k 3 stages", sr_bulk<256, 2048, 3, false>, 256, 3 * 12 * 2048, 2);
  persistent("bulk loads 256 tile2k 4 stages", sr_bulk<256, 2048, 4, false>, 256, 4 * 12 * 2048, 2);
  persistent("bulk loads 256 tile4k 3 stages", sr_bulk<256, 4096, 3, false>, 256, 3 * 12 * 4096, 1);
  persistent("bulk loads+stores 256 tile2k 4 stages", sr_bulk<256, 2048, 4, true>, 256,
             4 * 12 * 2048, 2);
  CK(cudaGetLastError());

  // The library kernel's table (one slot, n / 65536 chunks) for buffers b, in device memory.
  std::vector<void*> tables;
  const auto with_table = [&](Buffers b) {
    std::vector<int64_t> words(6 + 2 * (b.n / 65536));
    const LibSlot slot{b.p, b.g, b.m, b.v, b.n, 0};
    memcpy(words.data(), &slot, sizeof slot);
    for (int64_t c = 0; c < b.n / 65536; ++c) {
      words[6 + 2 * c] = 0;
      words[6 + 2 * c + 1] = c * 65536;
    }
    void* d = nullptr;
    cudaMalloc(&d, words.size() * 8);
    cudaMemcpy(d, words.data(), words.size() * 8, cudaMemcpyHostToDevice);
    tables.push_back(d);
    b.slots = static_cast<const LibSlot*>(d);
    b.chunks = static_cast<const int64_t*>(d) + 6;
    return b;
  };
  static_assert(sizeof(LibSlot) == 6 * 8);

  // Bitwise check on 2^22 elements: every variant once on fresh inputs against the reference.
  {
    const int64_t nc = int64_t(1) << 22;
    Bits *pc, *gc;
    float *mc, *vc;
    CK(cudaMalloc(&pc, nc * 2));
    CK(cudaMalloc(&gc, nc * 2));
    CK(cudaMalloc(&mc, nc * 4));
    CK(cudaMalloc(&vc, nc * 4));
    const Buffers bc = with_table({pc, gc, mc, vc, nc, nullptr, nullptr});
    std::vector<Bits> ref_p(nc), out_p(nc);
    std::vector<float> ref_m(nc), ref_v(nc), out_m(nc), out_v(nc);
    printf("--- bitwise check of the access variants on %lld elements (p, m, v)\n", (long long)nc);
    for (std::size_t k = 0; k < access.size(); ++k) {
      randomise_at(pc, gc, mc, vc, nc, false);
      access[k].launch(bc);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(out_p.data(), pc, nc * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(out_m.data(), mc, nc * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(out_v.data(), vc, nc * 4, cudaMemcpyDeviceToHost));
      if (k == 0) {
        ref_p = out_p;
        ref_m = out_m;
        ref_v = out_v;
        printf("%-58s reference\n", access[k].name.c_str());
        continue;
      }
      int64_t bad = 0;
      for (int64_t i = 0; i < nc; ++i) {
        bad += ref_p[i] != out_p[i] || memcmp(&ref_m[i], &out_m[i], 4) != 0 ||
               memcmp(&ref_v[i], &out_v[i], 4) != 0;
      }
      if (bad == 0) {
        printf("%-58s match\n", access[k].name.c_str());
      } else {
        printf("%-58s MISMATCH %lld\n", access[k].name.c_str(), (long long)bad);
      }
    }
    fflush(stdout);
    CK(cudaFree(pc));
    CK(cudaFree(gc));
    CK(cudaFree(mc));
    CK(cudaFree(vc));
  }

  randomise(false);
  const Buffers big = with_table({P, G, M, V, n, nullptr, nullptr});
  std::vector<Variant> access_list{copy_uncapped};
  for (const SrVariant& a : access) {
    access_list.push_back({a.name, b22, [&big, launch = a.launch] { launch(big); }});
  }
  run_list("AdamW access patterns, fp32 moments (22 B/element)", access_list);
  CK(cudaGetLastError());
  if (lists == "access") {
    return 0;
  }

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
