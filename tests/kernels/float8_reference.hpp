// The float8 quantisation of d9d/kernels/float8.hpp written again from its definition, in double,
// for the tests: the scale from the largest magnitude (the division in float32, as defined), the
// value rounded to the nearest float8 value found by search over the format's finite values
// (decoded from their bytes), ties to the even byte. Independent of the kernels' arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace d9d::testing {

/// The finite values of a float8 format with their bytes, sorted by value (one zero).
inline const std::vector<std::pair<double, uint8_t>>& float8_values(at::ScalarType format) {
  static const auto table = [](at::ScalarType f) {
    std::vector<std::pair<double, uint8_t>> out;
    auto bytes = at::arange(256, at::kInt).to(at::kByte).view(f).to(at::kDouble);
    for (int b = 0; b < 256; ++b) {
      const double v = bytes[b].item<double>();
      if (std::isfinite(v) && !(v == 0.0 && b != 0)) {
        out.emplace_back(v, static_cast<uint8_t>(b));
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  static const auto e4m3 = table(at::kFloat8_e4m3fn);
  static const auto e5m2 = table(at::kFloat8_e5m2);
  return format == at::kFloat8_e4m3fn ? e4m3 : e5m2;
}

/// v rounded to the nearest value of the format (ties: the even byte), saturating at its range.
inline double float8_round(double v, at::ScalarType format) {
  const auto& values = float8_values(format);
  if (std::isnan(v)) {
    return v;
  }
  const auto above = std::lower_bound(values.begin(), values.end(), std::make_pair(v, uint8_t{0}));
  if (above == values.begin()) {
    return values.front().first;
  }
  if (above == values.end()) {
    return values.back().first;
  }
  const auto below = above - 1;
  const double up = above->first - v;
  const double down = v - below->first;
  if (up != down) {
    return up < down ? above->first : below->first;
  }
  return (above->second & 1U) == 0 ? above->first : below->first;
}

struct Float8Reference {
  at::Tensor values;  ///< the quantised values q (double), laid out as the output
  at::Tensor scale;   ///< 1/s per output row [rows, 1], or 0-dimensional
};

/// The definition: v = x as float32 (times x_scale for a float8 x); per output row (rowwise) or for
/// the tensor, s = 2^floor(log2(M / max(a, 1e-12))) with the division in float32; q = round(v s).
inline Float8Reference float8_reference(const at::Tensor& x, at::ScalarType format, bool rowwise,
                                        bool transpose, const at::Tensor& x_scale = {}) {
  auto v = x.to(at::kFloat).to(at::kDouble);
  if (x_scale.defined()) {
    v = v * x_scale.to(at::kDouble);
  }
  if (transpose) {
    v = v.t().contiguous();
  }
  const double max = format == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
  const int64_t rows = v.size(0);
  const int64_t groups = rowwise ? rows : 1;
  auto q = at::empty_like(v);
  auto inverse = at::empty({groups}, at::kDouble);
  const auto scale_of = [&](double amax) {
    const float a = std::max(static_cast<float>(amax), 1e-12F);
    const float ratio = static_cast<float>(max) / a;
    return std::exp2(std::floor(std::log2(static_cast<double>(ratio))));
  };
  for (int64_t g = 0; g < groups; ++g) {
    const auto part = rowwise ? v[g] : v;
    const bool bad = !at::isfinite(part).all().item<bool>();
    const double s =
        bad ? std::numeric_limits<double>::quiet_NaN() : scale_of(part.abs().max().item<double>());
    inverse[g] = 1.0 / s;
    auto out = rowwise ? q[g] : q;
    const auto flat = part.reshape({-1});
    auto target = out.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      target[i] = bad ? std::numeric_limits<double>::quiet_NaN()
                      : float8_round(flat[i].item<double>() * s, format);
    }
  }
  return {.values = q,
          .scale = rowwise ? inverse.view({groups, 1}) : inverse.reshape(at::IntArrayRef{})};
}

}  // namespace d9d::testing
