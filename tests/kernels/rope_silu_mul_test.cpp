// d9d::rope and d9d::silu_mul on the CPU (the reference kernels): against the ATen compositions
// they replace, forward and backward, in double (to rounding) and in float32 / bfloat16 (to their
// rounding); argument errors name the argument.
#include <string>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <d9d/kernels/rope.hpp>
#include <d9d/kernels/silu_mul.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

// Half tables for positions [0, T) of a head of `dim`: cos/sin of t * theta^(-2i/dim).
std::pair<at::Tensor, at::Tensor> half_tables(int64_t positions, int64_t dim, at::ScalarType type) {
  const auto i = at::arange(0, dim / 2, at::kDouble);
  const auto inv_freq = at::pow(10000.0, -2.0 * i / static_cast<double>(dim));
  const auto angles = at::outer(at::arange(positions, at::kDouble), inv_freq);
  return {angles.cos().to(type), angles.sin().to(type)};
}

// The composition the model used before the op: x * cat(c, c) + rotate_half(x) * cat(s, s), with
// x [B, T, H, D] and the tables broadcast over batch and heads.
at::Tensor composite_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto c = at::cat({cos, cos}, -1).unsqueeze(1).to(x.scalar_type());  // [T, 1, D]
  const auto s = at::cat({sin, sin}, -1).unsqueeze(1).to(x.scalar_type());
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

TEST(Kernels_Rope_Cpu, ForwardAndBackwardEqualTheCompositionInDouble) {
  at::manual_seed(3);
  const auto [cos, sin] = half_tables(7, 8, at::kDouble);
  const auto x = at::randn({2, 7, 3, 8}, at::kDouble).requires_grad_(true);
  const auto dy = at::randn({2, 7, 3, 8}, at::kDouble);
  const auto y = d9d::kernels::rope(x, cos, sin);
  const auto want = composite_rope(x, cos, sin);
  EXPECT_TRUE(at::allclose(y, want, 1e-14, 1e-14));
  const auto dx = torch::autograd::grad({y}, {x}, {dy})[0];
  const auto dx_want = torch::autograd::grad({want}, {x}, {dy})[0];
  EXPECT_TRUE(at::allclose(dx, dx_want, 1e-14, 1e-14));
  // The inverse rotation undoes the rotation.
  EXPECT_TRUE(
      at::allclose(d9d::kernels::rope_forward(y.detach(), cos, sin, true), x, 1e-14, 1e-14));
  // Position 0 is the identity (cos 1, sin 0).
  EXPECT_TRUE(at::equal(y.detach().select(1, 0), x.detach().select(1, 0)));
}

TEST(Kernels_Rope_Cpu, LowPrecisionRoundsOnceFromFloat) {
  at::manual_seed(4);
  const auto [cos, sin] = half_tables(5, 16, at::kFloat);
  const auto x = at::randn({3, 5, 4, 16}, at::kDouble);
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    // The exact rotation of the rounded input, rounded once: within half an ulp of the output
    // dtype (2^-8 of |y| for bf16, 2^-11 for half, 2^-24 for float), |y| <= |x1| + |x2| < 10.
    const auto rounded = x.to(type);
    const auto want =
        composite_rope(rounded.to(at::kDouble), cos.to(at::kDouble), sin.to(at::kDouble));
    const auto y = d9d::kernels::rope(rounded, cos, sin);
    EXPECT_EQ(y.scalar_type(), type);
    const double eps = type == at::kBFloat16 ? 1.0 / 256 : type == at::kHalf ? 1.0 / 2048 : 1e-6;
    EXPECT_TRUE(at::allclose(y.to(at::kDouble), want, 0.0, 10 * eps)) << type;
  }
}

TEST(Kernels_Rope_Cpu, NonContiguousInputsAndErrors) {
  const auto tables = half_tables(4, 8, at::kFloat);  // named: the lambdas below capture them
  const at::Tensor& cos = tables.first;
  const at::Tensor& sin = tables.second;
  const auto x = at::randn({2, 3, 4, 8}).transpose(1, 2);  // [2, 4, 3, 8], strided
  EXPECT_TRUE(
      at::allclose(d9d::kernels::rope(x, cos, sin), composite_rope(x, cos, sin), 1e-6, 1e-6));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::kernels::rope(at::randn({4, 3, 7}), cos, sin);
              }),
              HasSubstr("d9d::rope: the last dimension must be even, got 7"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::kernels::rope(at::randn({5, 3, 8}), cos, sin);
              }),
              HasSubstr("d9d::rope: cos must be [T, D/2] = [5, 4], got [4, 4]"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::kernels::rope(at::randn({4, 3, 8}), cos.to(at::kDouble), sin);
              }),
              HasSubstr("d9d::rope: cos and sin must be Float for Float inputs"));
}

TEST(Kernels_SiluMul_Cpu, ForwardAndBackwardEqualTheCompositionInDouble) {
  at::manual_seed(5);
  const auto gate = (3 * at::randn({4, 37}, at::kDouble)).requires_grad_(true);
  const auto up = at::randn({4, 37}, at::kDouble).requires_grad_(true);
  const auto dh = at::randn({4, 37}, at::kDouble);
  const auto h = d9d::kernels::silu_mul(gate, up);
  const auto want = at::silu(gate) * up;
  EXPECT_TRUE(at::allclose(h, want, 1e-14, 1e-14));
  const auto got = torch::autograd::grad({h}, {gate, up}, {dh});
  const auto expected = torch::autograd::grad({want}, {gate, up}, {dh});
  EXPECT_TRUE(at::allclose(got[0], expected[0], 1e-13, 1e-13)) << "grad gate";
  EXPECT_TRUE(at::allclose(got[1], expected[1], 1e-14, 1e-14)) << "grad up";
}

TEST(Kernels_SiluMul_Cpu, LowPrecisionAndErrors) {
  at::manual_seed(6);
  const auto gate = at::randn({1000}, at::kDouble);
  const auto up = at::randn({1000}, at::kDouble);
  const auto want = at::silu(gate) * up;
  const auto h = d9d::kernels::silu_mul(gate.to(at::kBFloat16), up.to(at::kBFloat16));
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  // Inputs rounded to bf16 (2^-9 relative each) and one output rounding: within 2^-6.
  EXPECT_TRUE(at::allclose(h.to(at::kDouble), want, 1.0 / 64, 1.0 / 64));
  EXPECT_THAT(d9d::testing::error_of([] {
                (void)d9d::kernels::silu_mul(at::randn({2, 3}), at::randn({3, 2}));
              }),
              HasSubstr("d9d::silu_mul: up has shape [3, 2], gate has [2, 3]"));
  EXPECT_THAT(d9d::testing::error_of([] {
                (void)d9d::kernels::silu_mul(at::randn({2}), at::randn({2}, at::kDouble));
              }),
              HasSubstr("d9d::silu_mul: up is Double, gate is Float"));
}

}  // namespace
