// d9d::copy_stochastic_ and d9d::adamw_stochastic_ on the CPU (the reference kernels), and
// optim::StochasticAdamW: every result is one of the two bfloat16 neighbours of the exact value,
// the rounding is unbiased (a mean over many elements lands on the exact value within a few
// standard errors, where round-to-nearest is off by the whole update), the moments are AdamW's,
// and a step is reproducible from its seed.
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/kernels/stochastic.hpp>
#include <d9d/optim/adamw.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

// The bfloat16 neighbours of each double: floor and ceil on the bfloat16 grid (ties collapse).
std::pair<at::Tensor, at::Tensor> bf16_neighbours(const at::Tensor& exact) {
  const auto nearest = exact.to(at::kBFloat16).to(at::kDouble);
  // One bfloat16 step at the nearest value's exponent (8 significant bits).
  const auto step = at::pow(2.0, at::floor(at::log2(nearest.abs().clamp_min(1e-30))) - 7);
  const auto below = at::where(nearest > exact, nearest - step, nearest);
  const auto above = at::where(nearest < exact, nearest + step, nearest);
  return {below, above};
}

// Fraction of `n` Bernoulli(p) draws: within 6 standard errors of p (a 1e-9 false alarm rate).
void expect_fraction(double observed, double p, int64_t n, const std::string& what) {
  const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(n));
  EXPECT_NEAR(observed, p, 6 * sigma) << what;
}

TEST(Kernels_CopyStochastic_Cpu, RoundsToANeighbourUpWithTheDroppedFraction) {
  constexpr int64_t kN = 200000;
  const double ulp = std::ldexp(1.0, -7);  // bfloat16 step in [1, 2)
  for (const double sign : {1.0, -1.0}) {
    const double value = sign * (1.0 + 0.3 * ulp);
    const auto src = at::full({kN}, value, at::kFloat);
    auto dst = at::empty({kN}, at::kBFloat16);
    d9d::kernels::copy_stochastic_(dst, src, /*seed=*/11);
    const auto out = dst.to(at::kDouble);
    const auto up = (out.abs() == 1.0 + ulp).to(at::kDouble);
    const auto down = (out.abs() == 1.0).to(at::kDouble);
    EXPECT_EQ((up + down).sum().item<double>(), kN) << "every value is a neighbour";
    expect_fraction(up.mean().item<double>(), 0.3, kN, "rounded up, sign " + std::to_string(sign));
    // Round-to-nearest would give 1.0 everywhere: the mean would be off by 0.3 ulp.
    EXPECT_NEAR(out.mean().item<double>(), value, 6 * ulp * std::sqrt(0.21 / kN));
  }
  // Exact bfloat16 values, infinities and NaN pass unchanged.
  const auto special = at::tensor({1.5F, -2.0F, INFINITY, -INFINITY, NAN, 0.0F}, at::kFloat);
  auto dst = at::empty({6}, at::kBFloat16);
  d9d::kernels::copy_stochastic_(dst, special, 3);
  const auto back = dst.to(at::kFloat);
  EXPECT_TRUE(at::equal(back.narrow(0, 0, 4), special.narrow(0, 0, 4)));
  EXPECT_TRUE(std::isnan(back[4].item<float>()));
  EXPECT_EQ(back[5].item<float>(), 0.0F);
}

TEST(Kernels_CopyStochastic_Cpu, IsReproducibleFromItsSeed) {
  const auto src = at::randn({4096}, at::kFloat);
  auto a = at::empty({4096}, at::kBFloat16);
  auto b = at::empty({4096}, at::kBFloat16);
  auto c = at::empty({4096}, at::kBFloat16);
  d9d::kernels::copy_stochastic_(a, src, 5);
  d9d::kernels::copy_stochastic_(b, src, 5);
  d9d::kernels::copy_stochastic_(c, src, 6);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
}

// AdamW in double from the same bfloat16 parameters and moments.
struct Reference {
  at::Tensor param, m, v;
};
Reference adamw_reference(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                          const at::Tensor& v, const d9d::kernels::AdamWStep& s) {
  const auto pd = p.to(at::kDouble) * (1 - s.lr * s.weight_decay);
  const auto gd = g.to(at::kDouble);
  const auto md = s.beta1 * m.to(at::kDouble) + (1 - s.beta1) * gd;
  const auto vd = s.beta2 * v.to(at::kDouble) + (1 - s.beta2) * gd * gd;
  const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(s.step));
  const auto update = (s.lr / bc1) * md / (vd.sqrt() / std::sqrt(bc2) + s.eps);
  return {pd - update, md, vd};
}

TEST(Kernels_AdamWStochastic_Cpu, EachParameterIsANeighbourOfAdamWsUpdate) {
  at::manual_seed(4);
  const d9d::kernels::AdamWStep step{
      .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 3};
  for (const auto grad_type : {at::kBFloat16, at::kFloat}) {
    // Odd sizes: a tail after every chunk; several tensors in one call.
    std::vector<at::Tensor> params = {at::randn({37, 50}).to(at::kBFloat16),
                                      at::randn({1001}).to(at::kBFloat16)};
    std::vector<at::Tensor> grads, ms, vs;
    std::vector<Reference> refs;
    for (const auto& p : params) {
      grads.push_back(at::randn(p.sizes()).to(grad_type));
      ms.push_back(at::randn(p.sizes()) * 0.1);
      vs.push_back(at::rand(p.sizes()) * 0.01);
      refs.push_back(adamw_reference(p, grads.back(), ms.back(), vs.back(), step));
    }
    d9d::kernels::adamw_stochastic_(params, grads, ms, vs, step, /*seed=*/7);
    for (std::size_t t = 0; t < params.size(); ++t) {
      const auto got = params[t].to(at::kDouble);
      // float32 arithmetic first (relative 1e-6 of the update's terms), then one rounding.
      const auto [below, above] = bf16_neighbours(refs[t].param);
      const auto slack = 1e-6 * (refs[t].param.abs() + 1);
      EXPECT_TRUE(((got >= below - slack) & (got <= above + slack)).all().item<bool>())
          << "tensor " << t << " grads " << grad_type;
      EXPECT_TRUE(at::allclose(ms[t].to(at::kDouble), refs[t].m, 1e-6, 1e-7)) << t;
      EXPECT_TRUE(at::allclose(vs[t].to(at::kDouble), refs[t].v, 1e-6, 1e-8)) << t;
    }
  }
}

TEST(Kernels_AdamWStochastic_Cpu, SmallUpdatesAreKeptOnAverage) {
  // Every parameter is 1.0 and its first step moves it by lr (AdamW's first update is lr * sign):
  // 0.3 of a bfloat16 step below 1.0. Round-to-nearest keeps 1.0 everywhere; stochastic rounding
  // moves 30% of the parameters down one step, so the mean follows the float32 update.
  constexpr int64_t kN = 200000;
  const double ulp_below_one = std::ldexp(1.0, -8);
  const d9d::kernels::AdamWStep step{.lr = 0.3 * ulp_below_one, .eps = 0.0, .step = 1};
  std::vector<at::Tensor> params = {at::ones({kN}, at::kBFloat16)};
  std::vector<at::Tensor> grads = {at::full({kN}, 0.5, at::kBFloat16)};
  std::vector<at::Tensor> ms = {at::zeros({kN}, at::kBFloat16)};
  std::vector<at::Tensor> vs = {at::zeros({kN}, at::kBFloat16)};
  d9d::kernels::adamw_stochastic_(params, grads, ms, vs, step, 21);
  const auto out = params[0].to(at::kDouble);
  const auto down = (out == 1.0 - ulp_below_one).to(at::kDouble);
  EXPECT_EQ(((out == 1.0) | (out == 1.0 - ulp_below_one)).sum().item<int64_t>(), kN);
  expect_fraction(down.mean().item<double>(), 0.3, kN, "moved down");
  // bfloat16 moments: m = 0.05 and v = 0.00025 to within one bfloat16 step.
  EXPECT_TRUE(at::allclose(ms[0].to(at::kDouble), at::full({kN}, 0.05, at::kDouble), 1.0 / 128));
  EXPECT_TRUE(at::allclose(vs[0].to(at::kDouble), at::full({kN}, 0.00025, at::kDouble), 1.0 / 128));
}

TEST(Kernels_AdamWStochastic_Cpu, ArgumentErrorsNameTheArgument) {
  std::vector<at::Tensor> p32 = {at::zeros({4})};
  std::vector<at::Tensor> p = {at::zeros({4}, at::kBFloat16)};
  std::vector<at::Tensor> g = {at::zeros({4})};
  std::vector<at::Tensor> g3 = {at::zeros({3})};
  std::vector<at::Tensor> m = {at::zeros({4})};
  std::vector<at::Tensor> none;
  const d9d::kernels::AdamWStep step;
  EXPECT_THAT(d9d::testing::error_of<c10::Error>(
                  [&] { d9d::kernels::adamw_stochastic_(p32, g, m, m, step, 0); }),
              HasSubstr("the parameters must be bfloat16"));
  EXPECT_THAT(d9d::testing::error_of<c10::Error>(
                  [&] { d9d::kernels::adamw_stochastic_(p, g3, m, m, step, 0); }),
              HasSubstr("grads[0] has shape [3]"));
  EXPECT_THAT(d9d::testing::error_of<c10::Error>(
                  [&] { d9d::kernels::adamw_stochastic_(p, none, m, m, step, 0); }),
              HasSubstr("the lists differ in length"));
  auto dst = at::empty({4}, at::kFloat);
  EXPECT_THAT(d9d::testing::error_of<c10::Error>(
                  [&] { d9d::kernels::copy_stochastic_(dst, at::zeros({4}), 0); }),
              HasSubstr("dst is Float; it must be bfloat16"));
}

TEST(Optim_StochasticAdamW, FollowsFloat32AdamWAndIsReproducible) {
  // A least-squares fit with bfloat16 parameters: the stochastic optimizer's parameters stay
  // within bfloat16 noise of float32 AdamW's after 50 steps, two runs with one seed agree bit for
  // bit, and another seed draws other bits.
  at::manual_seed(12);
  const auto x = at::randn({64, 16});
  const auto target = x.matmul(at::randn({16, 1}));
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.01);
  const auto init = at::randn({16, 1}) * 0.1;
  const auto fit = [&](auto make_optimizer, at::ScalarType type) {
    auto w = init.to(type).detach().clone().requires_grad_(true);
    auto optimizer = make_optimizer(std::vector<at::Tensor>{w});
    for (int i = 0; i < 50; ++i) {
      optimizer.zero_grad();
      const auto loss = (x.to(type).matmul(w) - target.to(type)).pow(2).mean();
      loss.backward();
      optimizer.step();
    }
    return w.detach().to(at::kDouble);
  };
  const auto sr = [&](uint64_t seed) {
    return [&, seed](std::vector<at::Tensor> p) {
      return d9d::optim::StochasticAdamW({torch::optim::OptimizerParamGroup(std::move(p))}, options,
                                         {.seed = seed});
    };
  };
  const auto reference =
      fit([&](std::vector<at::Tensor> p) { return torch::optim::AdamW(std::move(p), options); },
          at::kFloat);
  const auto a = fit(sr(1), at::kBFloat16);
  const auto b = fit(sr(1), at::kBFloat16);
  const auto c = fit(sr(2), at::kBFloat16);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
  // 50 updates of at most lr each, every rounding at most one bfloat16 step (2^-8 relative):
  // the trajectories stay within a few steps of each other.
  const auto tolerance = 8 * std::ldexp(1.0, -8) * (reference.abs() + 0.1);
  EXPECT_TRUE(((a - reference).abs() <= tolerance).all().item<bool>())
      << "max diff " << (a - reference).abs().max().item<double>();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                d9d::optim::StochasticAdamW bad(
                    {torch::optim::OptimizerParamGroup({init.to(at::kBFloat16).detach()})}, options,
                    {.state_dtype = at::kDouble});
              }),
              HasSubstr("float32 or bfloat16"));
}

}  // namespace
