// d9d::model::float8_linear on the CPU (the emulation of the float8 GEMMs): forward, input and
// weight gradients against the definition written again in double (quantise each operand along
// the product's contracted dimension, dequantise, multiply; tests/kernels/float8_reference.hpp),
// to float32 rounding, per row and per tensor; a Linear with `float8` set runs it (bias added);
// split backward defers the float8 weight-gradient GEMM and gives the same gradients; the result
// is float8's, not float32's; layers that share an input reuse its quantisation until it changes.
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <d9d/core/weight_grad.hpp>
#include <d9d/model/layers.hpp>

#include "tests/kernels/float8_reference.hpp"

namespace {

constexpr double kFloatEps = 6e-8;  // float32's unit roundoff

at::Tensor dequantized(const d9d::testing::Float8Reference& r) { return r.values * r.scale; }

struct Expected {
  at::Tensor y, dx, dw;          // double
  at::Tensor dx_left, dx_right;  // dx's operands: dx = dx_left dx_right^T
};

// The definition, for x [M, K], w [N, K], g [M, N] (float32 values).
Expected definition(const at::Tensor& x, const at::Tensor& w, const at::Tensor& g, bool rowwise) {
  using d9d::testing::float8_reference;
  const auto e4m3 = at::kFloat8_e4m3fn;
  const auto gradient_format = rowwise ? e4m3 : at::kFloat8_e5m2;
  const auto w8 = float8_reference(w, e4m3, rowwise, false);
  const auto wq = dequantized(w8);
  Expected out;
  out.y = at::mm(dequantized(float8_reference(x, e4m3, rowwise, false)), wq.t());
  // dx = g W with W as the forward used it: per row, W = diag(s) q with s folded into g's columns
  // before g is quantised per token, q's values as they are; per tensor, g per tensor and W whole.
  if (rowwise) {
    const auto s = w8.scale.to(at::kFloat).view({1, -1});
    out.dx_left = dequantized(float8_reference(g, gradient_format, true, false, s));
    out.dx_right = w8.values.t();
  } else {
    out.dx_left = dequantized(float8_reference(g, gradient_format, false, false));
    out.dx_right = wq.t();
  }
  out.dx = at::mm(out.dx_left, out.dx_right.t());
  // dW = g^T x, both along the tokens.
  out.dw = at::mm(dequantized(float8_reference(g, gradient_format, rowwise, true)),
                  dequantized(float8_reference(x, e4m3, rowwise, true)).t());
  return out;
}

// |got - want| within float32 summation rounding of the products a b (per element).
void expect_product_close(const at::Tensor& got, const at::Tensor& want, const at::Tensor& bound,
                          const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const auto diff = (got.to(at::kDouble) - want).abs();
  EXPECT_TRUE((diff <= bound).all().item<bool>())
      << what << ": max diff " << diff.max().item<double>() << ", max bound "
      << bound.max().item<double>();
  EXPECT_GT(want.abs().max().item<double>(), 0.0) << what;
}

class Model_Float8Linear : public ::testing::TestWithParam<bool> {};

TEST_P(Model_Float8Linear, ForwardAndGradientsEqualTheDefinition) {
  const bool rowwise = GetParam();
  at::manual_seed(21);
  d9d::model::Linear linear(32, 48);
  linear->float8 =
      d9d::model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
  // Tokens of different magnitudes, so per-row and per-tensor scales differ.
  const auto x =
      (at::randn({2, 8, 32}) * at::pow(4.0, at::arange(8, at::kFloat) - 4).view({1, 8, 1}))
          .requires_grad_(true);
  const auto g = at::randn({2, 8, 48});
  const auto y = linear(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 8, 48}));
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  torch::autograd::backward({y}, {g});
  const auto want = definition(x.detach().reshape({16, 32}), linear->weight.detach(),
                               g.reshape({16, 48}), rowwise);
  // Bounds: K products summed in float32 (K = 32, 48 or 16), with room: 2 K u |a| |b|.
  const auto abs_bound = [](const at::Tensor& a, const at::Tensor& b, int64_t k) {
    return 2.0 * static_cast<double>(k) * kFloatEps * at::mm(a.abs(), b.abs().t()) + 1e-30;
  };
  using d9d::testing::float8_reference;
  const auto xq = dequantized(
      float8_reference(x.detach().reshape({16, 32}), at::kFloat8_e4m3fn, rowwise, false));
  const auto wq =
      dequantized(float8_reference(linear->weight.detach(), at::kFloat8_e4m3fn, rowwise, false));
  expect_product_close(y.detach().reshape({16, 48}), want.y, abs_bound(xq, wq, 32), "forward");
  const auto gf = rowwise ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  expect_product_close(x.grad().reshape({16, 32}), want.dx,
                       abs_bound(want.dx_left, want.dx_right, 48), "dx");
  const auto gt = dequantized(float8_reference(g.reshape({16, 48}), gf, rowwise, true));
  const auto xt = dequantized(
      float8_reference(x.detach().reshape({16, 32}), at::kFloat8_e4m3fn, rowwise, true));
  expect_product_close(linear->weight.grad(), want.dw, abs_bound(gt, xt, 16), "dW");
}

TEST_P(Model_Float8Linear, IsFloat8NotFloat32AndAddsTheBias) {
  const bool rowwise = GetParam();
  at::manual_seed(22);
  d9d::model::Linear linear(64, 32, /*bias=*/true);
  const auto x = at::randn({4, 6, 64});
  const auto plain = linear(x).detach();
  linear->float8 =
      d9d::model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
  const auto y = linear(x);
  const auto without_bias = d9d::model::float8_linear(x, linear->weight, *linear->float8);
  EXPECT_TRUE(at::equal(y.detach(), (without_bias + linear->bias).detach()));
  // e4m3's 3 mantissa bits: a few percent of relative error, far above float32's.
  const double relative = ((y.detach() - plain).norm() / plain.norm()).item<double>();
  EXPECT_GT(relative, 1e-3);
  EXPECT_LT(relative, 0.1);
  y.sum().backward();
  EXPECT_TRUE(at::allclose(linear->bias.grad(), at::full({32}, 24.0)));
}

TEST_P(Model_Float8Linear, SplitBackwardDefersTheFloat8WeightGradient) {
  const bool rowwise = GetParam();
  at::manual_seed(23);
  d9d::model::Linear linear(32, 16);
  linear->float8 =
      d9d::model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
  const auto x = at::randn({3, 16, 32}).requires_grad_(true);
  const auto g = at::randn({3, 16, 16});
  // Direct backward.
  torch::autograd::backward({linear(x)}, {g});
  const auto dx = x.grad().clone();
  const auto dw = linear->weight.grad().clone();
  x.mutable_grad() = at::Tensor();
  linear->weight.mutable_grad() = at::Tensor();
  // Split: the input gradient in backward, the weight's when the queue drains.
  d9d::WeightGradQueue queue;
  at::Tensor y;
  {
    const d9d::RecordWeightGrads record(queue);
    y = linear(x);
  }
  {
    const d9d::DeferWeightGrads defer(queue);
    torch::autograd::backward({y}, {g});
  }
  EXPECT_TRUE(at::equal(x.grad(), dx));
  EXPECT_FALSE(linear->weight.grad().defined());
  EXPECT_EQ(queue.size(), 1U);
  queue.drain();
  EXPECT_TRUE(at::equal(linear->weight.grad(), dw));
}

TEST_P(Model_Float8Linear, LayersSharingAnInputQuantiseItOnceAndSeeItsChanges) {
  const bool rowwise = GetParam();
  at::manual_seed(24);
  d9d::model::Linear a(32, 16);
  d9d::model::Linear b(32, 48);
  a->float8 = d9d::model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
  b->float8 = a->float8;
  auto x = at::randn({2, 16, 32});
  static_cast<void>(a(x));
  const auto shared = b(x);  // x's quantisation comes from a's call
  EXPECT_TRUE(at::equal(shared, b(x.clone())));
  {
    const at::NoGradGuard no_grad;
    x.mul_(3.0);  // the same tensor, new values: quantised again
  }
  const auto changed = b(x);
  EXPECT_TRUE(at::equal(changed, b(x.clone())));
  EXPECT_FALSE(at::equal(changed, shared));
}

INSTANTIATE_TEST_SUITE_P(Scaling, Model_Float8Linear, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "rowwise" : "tensorwise"; });

}  // namespace
