// d9d::rms_norm on CPU: the custom op against an eager ATen composition differentiated by autograd.
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <d9d/kernels/rms_norm.hpp>

#include "tests/kernels/rms_norm_cases.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::error_of;

// The textbook definition, computed in the accumulation dtype and rounded once (to `out`, default
// the input's dtype).
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, double eps,
                     std::optional<at::ScalarType> out = std::nullopt) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto xf = x.to(acc);
  const auto rstd = (xf.pow(2).mean({-1}, /*keepdim=*/true) + eps).rsqrt();
  return (xf * rstd * w.to(acc)).to(out.value_or(x.scalar_type()));
}

using Case = d9d::testing::RmsNormCase;

class Kernels_RmsNorm_Cpu : public ::testing::TestWithParam<Case> {};

TEST_P(Kernels_RmsNorm_Cpu, ForwardMatchesComposition) {
  const auto& c = GetParam();
  at::manual_seed(0);
  const auto x = at::randn(c.shape, at::kDouble).to(c.dtype);
  const auto w = (1.0 + 0.1 * at::randn({c.shape.back()}, at::kDouble)).to(c.weight());
  const auto got = d9d::kernels::rms_norm(x, w, 1e-6, c.out_arg());
  EXPECT_EQ(got.sizes(), x.sizes());
  EXPECT_EQ(got.scalar_type(), c.out());
  const auto want = reference(x, w, 1e-6, c.out());
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), c.rtol, c.atol))
      << "max abs diff " << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
}

TEST_P(Kernels_RmsNorm_Cpu, BackwardMatchesAutogradOfComposition) {
  const auto& c = GetParam();
  at::manual_seed(1);
  const auto x0 = at::randn(c.shape, at::kDouble).to(c.dtype);
  const auto w0 = (1.0 + 0.1 * at::randn({c.shape.back()}, at::kDouble)).to(c.weight());
  const auto dy = at::randn(c.shape, at::kDouble).to(c.out());

  // The reference: autograd through the composition, in double, rounded to the dtype at the end.
  auto xr = x0.to(at::kDouble).detach().requires_grad_(true);
  auto wr = w0.to(at::kDouble).detach().requires_grad_(true);
  const auto yr = reference(xr, wr, 1e-6);
  const auto ref_grads = torch::autograd::grad({yr}, {xr, wr}, {dy.to(at::kDouble)});

  auto x = x0.detach().requires_grad_(true);
  auto w = w0.detach().requires_grad_(true);
  const auto y = d9d::kernels::rms_norm(x, w, 1e-6, c.out_arg());
  ASSERT_EQ(y.scalar_type(), c.out());
  const auto grads = torch::autograd::grad({y}, {x, w}, {dy});

  ASSERT_EQ(grads[0].scalar_type(), c.dtype);
  ASSERT_EQ(grads[1].scalar_type(), c.weight());
  // grad_weight sums over every row, so its error grows with the row count.
  const double rows = static_cast<double>(x0.numel()) / static_cast<double>(c.shape.back());
  EXPECT_TRUE(at::allclose(grads[0].to(at::kDouble), ref_grads[0], c.rtol, c.atol))
      << "grad_input max abs diff "
      << (grads[0].to(at::kDouble) - ref_grads[0]).abs().max().item<double>();
  EXPECT_TRUE(at::allclose(grads[1].to(at::kDouble), ref_grads[1], c.rtol, c.atol * rows))
      << "grad_weight max abs diff "
      << (grads[1].to(at::kDouble) - ref_grads[1]).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Kernels_RmsNorm_Cpu,
    ::testing::Values(
        Case{at::kDouble, {4, 7, 64}, 1e-10, 1e-12}, Case{at::kDouble, {3, 33}, 1e-10, 1e-12},
        Case{at::kFloat, {4, 7, 64}, 1e-5, 1e-6}, Case{at::kFloat, {5, 1}, 1e-5, 1e-6},
        Case{at::kFloat, {2, 3, 4, 4096}, 1e-4, 1e-5}, Case{at::kBFloat16, {8, 256}, 2e-2, 2e-2},
        Case{at::kHalf, {8, 100}, 5e-3, 5e-3},
        // Mixed precision: a float32 weight read by a bfloat16
        // or half input; a float32 input normalised into
        // bfloat16 or half.
        Case{at::kBFloat16, {8, 256}, 2e-2, 2e-2, at::kFloat},
        Case{at::kHalf, {6, 3, 96}, 5e-3, 5e-3, at::kFloat},
        Case{at::kFloat, {8, 256}, 2e-2, 2e-2, at::kFloat, at::kBFloat16},
        Case{at::kFloat, {5, 100}, 5e-3, 5e-3, at::kFloat, at::kHalf}),
    d9d::testing::RmsNormCaseName());

TEST(Kernels_RmsNorm_Cpu_Api, DispatcherOpWithoutGradMatchesFunction) {
  const auto x = at::randn({6, 32});
  const auto w = at::rand({32}) + 0.5;
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("d9d::rms_norm", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double,
                                        std::optional<at::ScalarType>)>();
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(op.call(x, w, 1e-5, std::nullopt), d9d::kernels::rms_norm(x, w, 1e-5)));
  EXPECT_TRUE(at::equal(op.call(x, w, 1e-5, at::kBFloat16),
                        d9d::kernels::rms_norm(x, w, 1e-5, at::kBFloat16)));
}

TEST(Kernels_RmsNorm_Cpu_Api, ForwardReturnsRstdPerRow) {
  const auto x = at::randn({2, 3, 16});
  const auto w = at::ones({16});
  const auto [y, rstd] = d9d::kernels::rms_norm_forward(x, w, 1e-6);
  EXPECT_EQ(rstd.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(rstd.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::allclose(rstd, (x.pow(2).mean({-1}) + 1e-6).rsqrt()));
}

TEST(Kernels_RmsNorm_Cpu_Api, EmptyInputGivesEmptyOutput) {
  const auto x = at::randn({0, 8});
  const auto y = d9d::kernels::rms_norm(x, at::ones({8}), 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
}

TEST(Kernels_RmsNorm_Cpu_Api, NonContiguousInputIsHandled) {
  const auto base = at::randn({16, 8});
  const auto x = base.t();  // [8, 16], not contiguous
  const auto w = at::rand({16}) + 0.5;
  EXPECT_TRUE(at::allclose(d9d::kernels::rms_norm(x, w, 1e-6), reference(x, w, 1e-6), 1e-5, 1e-6));
}

// A float32 weight with a bfloat16 input gives what the weight rounded to bfloat16 gave before, up
// to the one rounding of the product: the output within bfloat16's half-ulp of the float32 result,
// the weight's gradient in float32 (not rounded to bfloat16 and widened again).
TEST(Kernels_RmsNorm_Cpu_Api, Float32WeightWithBFloat16InputKeepsItsGradientInFloat32) {
  at::manual_seed(3);
  const auto x = at::randn({16, 64}).to(at::kBFloat16);
  auto w = (1.0 + 0.1 * at::randn({64})).requires_grad_(true);
  auto xg = x.detach().requires_grad_(true);
  const auto y = d9d::kernels::rms_norm(xg, w, 1e-6);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const auto dy = at::randn({16, 64}).to(at::kBFloat16);
  y.backward(dy);
  ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
  // The float32 reference of the weight's gradient: sum over rows of dy * x * rstd.
  const auto xf = x.to(at::kFloat);
  const auto rstd = (xf.pow(2).mean({-1}, true) + 1e-6).rsqrt();
  const auto want = (dy.to(at::kFloat) * xf * rstd).sum(0);
  EXPECT_TRUE(at::allclose(w.grad(), want, 1e-5, 1e-5))
      << (w.grad() - want).abs().max().item<double>();
}

// Under autocast the norm is asked for autocast's dtype; its input's gradient stays float32.
TEST(Kernels_RmsNorm_Cpu_Api, Float32InputNormalisedIntoBFloat16GivesAFloat32InputGradient) {
  auto x = at::randn({4, 32}).requires_grad_(true);
  auto w = (at::rand({32}) + 0.5).requires_grad_(true);
  const auto y = d9d::kernels::rms_norm(x, w, 1e-6, at::kBFloat16);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const auto want = reference(x.detach(), w.detach(), 1e-6, at::kBFloat16);
  EXPECT_TRUE(at::allclose(y.to(at::kFloat), want.to(at::kFloat), 1e-2, 1e-2));
  y.to(at::kFloat).sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
}

TEST(Kernels_RmsNorm_Cpu_Api, BadArgumentsNameTheProblem) {
  const auto x = at::randn({4, 8});
  EXPECT_NE(error_of([&] {
              (void)d9d::kernels::rms_norm(x, at::ones({7}), 1e-6);
            }).find("weight must have shape [8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)d9d::kernels::rms_norm(x, at::ones({8}, at::kDouble), 1e-6);
            }).find("weight dtype Double differs from input dtype Float"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] {
        (void)d9d::kernels::rms_norm(at::ones({4, 8}, at::kLong), at::ones({8}, at::kLong), 1e-6);
      }).find("input must be floating point"),
      std::string::npos);
  // A float32 weight only with bfloat16 and half inputs; another output dtype only from float32.
  EXPECT_NE(error_of([&] {
              (void)d9d::kernels::rms_norm(x.to(at::kDouble), at::ones({8}), 1e-6);
            }).find("weight dtype Float differs from input dtype Double"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)d9d::kernels::rms_norm(x.to(at::kBFloat16), at::ones({8}, at::kBFloat16), 1e-6,
                                           at::kFloat);
            }).find("no kernel for input BFloat16, weight BFloat16, output Float"),
            std::string::npos);
}

}  // namespace
