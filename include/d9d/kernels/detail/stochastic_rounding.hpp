// d9d/kernels/detail/stochastic_rounding.hpp — the counter-based random bits and the float32 →
// bfloat16 stochastic rounding shared by the CPU and CUDA kernels (src/kernels/stochastic.cpp,
// kernels/stochastic.cu), so both devices round the same value with the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define D9D_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define D9D_HOST_DEVICE inline
#endif

namespace d9d::kernels::detail {

/// A 64-bit finaliser (splitmix64's): 64 well-mixed bits from a counter. Random bits for element
/// `i` of tensor `t` under `seed` are mix64(seed ^ (t << 40) ^ i) — reproducible, independent of
/// the launch shape, and the same on every device.
D9D_HOST_DEVICE std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// The random bits of element `index` of tensor `tensor` under `seed`.
D9D_HOST_DEVICE std::uint64_t random_bits(std::uint64_t seed, std::uint64_t tensor,
                                          std::uint64_t index) {
  return mix64(seed ^ (tensor << 40) ^ index);
}

/// float32 → bfloat16 bits, rounded stochastically: adding 16 uniform random bits below the
/// bfloat16 mantissa and truncating rounds up with probability equal to the dropped fraction, so
/// E[round(x)] = x (the sign is separate, so negative values round symmetrically). Infinities stay
/// infinite, NaN stays NaN; a finite value may round up to infinity only from above the largest
/// bfloat16, as truncation would not.
D9D_HOST_DEVICE std::uint16_t stochastic_bf16_bits(float value, std::uint32_t random16) {
  std::uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(value);
#else
  std::memcpy(&bits, &value, sizeof bits);
#endif
  if ((bits & 0x7F800000U) == 0x7F800000U) {  // inf or NaN: keep the class
    const bool nan = (bits & 0x007FFFFFU) != 0;
    return static_cast<std::uint16_t>((bits >> 16) | (nan ? 0x0040U : 0U));
  }
  bits += random16 & 0xFFFFU;
  return static_cast<std::uint16_t>(bits >> 16);
}

/// The float value of bfloat16 bits.
D9D_HOST_DEVICE float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(wide);
#else
  float out = 0.0F;
  std::memcpy(&out, &wide, sizeof out);
  return out;
#endif
}

/// The hyper-parameters of one AdamW update, as the kernels use them (float32, bias corrections
/// folded in on the host).
struct AdamWScalars {
  float lr = 0.0F;
  float beta1 = 0.0F;
  float beta2 = 0.0F;
  float eps = 0.0F;
  float weight_decay = 0.0F;
  float step_size = 0.0F;              ///< lr / (1 - beta1^step)
  float bias_correction2_sqrt = 0.0F;  ///< sqrt(1 - beta2^step)
};

/// The scalars of an update at `step` (from 1), computed in double and rounded once.
inline AdamWScalars make_adamw_scalars(double lr, double beta1, double beta2, double eps,
                                       double weight_decay, std::int64_t step) {
  const auto n = static_cast<double>(step);
  return {.lr = static_cast<float>(lr),
          .beta1 = static_cast<float>(beta1),
          .beta2 = static_cast<float>(beta2),
          .eps = static_cast<float>(eps),
          .weight_decay = static_cast<float>(weight_decay),
          .step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, n))),
          .bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, n)))};
}

/// AdamW on one element in float32 (torch's formula: decoupled decay, then the moments, then the
/// bias-corrected step). Returns the new parameter; updates m and v in place.
D9D_HOST_DEVICE float adamw_element(float param, float grad, float& m, float& v,
                                    const AdamWScalars& s) {
  param *= 1.0F - s.lr * s.weight_decay;
  m = s.beta1 * m + (1.0F - s.beta1) * grad;
  v = s.beta2 * v + (1.0F - s.beta2) * grad * grad;
#if defined(__CUDA_ARCH__)
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
#else
  const float denom = __builtin_sqrtf(v) / s.bias_correction2_sqrt + s.eps;
#endif
  return param - s.step_size * m / denom;
}

}  // namespace d9d::kernels::detail
