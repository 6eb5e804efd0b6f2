// d9d::moe_route_indices, d9d::moe_permute and d9d::moe_unpermute on the CPU (the reference
// kernels) against the ATen composition d9d::model::MoeLayer used before them — at::sort (stable)
// + bincount + within_capacity + masked_select, index_select, index_add of the weighted rows —
// dropless and with a capacity, top_k 1 to 3, ties and an expert nobody chooses: the indices
// exactly, the rows and their gradients bit for bit in float32 and float64 (the weights' gradient
// to rounding), central differences in float64, one rounding from float in bfloat16 / float16;
// argument errors name the argument.
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <d9d/kernels/moe_permute.hpp>
#include <d9d/model/moe.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

at::Tensor longs(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

// The ATen composition: the kept pairs' order, their tokens, counts and kept counts, and the
// dropped pairs' order (by expert, stable).
struct Composition {
  at::Tensor order;
  at::Tensor token;
  at::Tensor counts;
  at::Tensor kept_counts;
  at::Tensor dropped_order;
};

Composition composition(const at::Tensor& chosen, int64_t experts, int64_t k, int64_t capacity) {
  auto [sorted_experts, order] =
      at::sort(chosen, std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  const auto counts = at::bincount(chosen, {}, experts);
  Composition c{.order = order,
                .token = at::Tensor(),
                .counts = counts,
                .kept_counts = counts,
                .dropped_order = at::empty({0}, at::kLong)};
  if (capacity >= 0) {
    const auto mask = d9d::model::within_capacity(sorted_experts, counts, capacity);
    c.order = order.masked_select(mask);
    c.dropped_order = order.masked_select(mask.logical_not());
    c.kept_counts = at::clamp_max(counts, capacity);
  }
  c.token = at::div(c.order, k, "floor");
  return c;
}

// N tokens' top-k choices among `experts`, each token's k distinct (as the router's top-k), with
// expert `unused` never chosen and heavy ties (few experts, many tokens).
at::Tensor topk_choices(int64_t tokens, int64_t experts, int64_t k, int64_t unused) {
  auto scores = at::rand({tokens, experts}, at::kDouble);
  scores.select(1, unused).fill_(-1.0);
  return std::get<1>(at::topk(scores, k, -1)).reshape({-1});
}

struct RouteCase {
  int64_t tokens;
  int64_t experts;
  int64_t k;
  std::string name;
};

std::vector<RouteCase> route_cases() {
  return {{.tokens = 23, .experts = 5, .k = 1, .name = "k1"},
          {.tokens = 40, .experts = 6, .k = 2, .name = "k2"},
          {.tokens = 17, .experts = 4, .k = 3, .name = "k3"},
          {.tokens = 300, .experts = 16, .k = 4, .name = "k4 many tokens"}};
}

// Everything moe_route_indices returns, checked against the composition (capacity < 0: dropless).
void expect_route_matches(const at::Tensor& chosen, int64_t experts, int64_t k, int64_t capacity,
                          const std::string& what) {
  const auto r = d9d::kernels::moe_route_indices(chosen, experts, k, capacity);
  const auto want = composition(chosen, experts, k, capacity);
  const int64_t kept = want.order.numel();
  const int64_t pairs = chosen.numel();
  ASSERT_EQ(r.order.numel(), pairs) << what;
  EXPECT_TRUE(at::equal(r.order.narrow(0, 0, kept), want.order)) << what;
  EXPECT_TRUE(at::equal(r.token.narrow(0, 0, kept), want.token)) << what;
  EXPECT_TRUE(at::equal(r.order.narrow(0, kept, pairs - kept), want.dropped_order)) << what;
  EXPECT_TRUE(at::equal(r.token, at::div(r.order, k, "floor"))) << what;
  EXPECT_TRUE(at::equal(r.counts, want.counts)) << what;
  EXPECT_TRUE(at::equal(r.kept_counts, want.kept_counts)) << what;
  ASSERT_EQ(r.position.sizes(), (std::vector<int64_t>{pairs / k, k})) << what;
  // position is order's inverse on the kept pairs and -1 on the dropped ones.
  const auto flat_position = r.position.reshape({-1});
  EXPECT_TRUE(at::equal(flat_position.index_select(0, r.order.narrow(0, 0, kept)),
                        at::arange(kept, at::kLong)))
      << what;
  EXPECT_TRUE(at::equal(flat_position.index_select(0, r.order.narrow(0, kept, pairs - kept)),
                        at::full({pairs - kept}, -1, at::kLong)))
      << what;
}

TEST(Kernels_MoeRoute_Cpu, DroplessEqualsTheStableSort) {
  at::manual_seed(1);
  for (const auto& c : route_cases()) {
    const auto chosen = topk_choices(c.tokens, c.experts, c.k, /*unused=*/1);
    expect_route_matches(chosen, c.experts, c.k, -1, c.name);
    const auto r = d9d::kernels::moe_route_indices(chosen, c.experts, c.k, -1);
    EXPECT_EQ(r.counts[1].item<int64_t>(), 0) << c.name << ": the expert nobody chose";
  }
  // Duplicates within a token (not what a top-k gives, but defined): still the stable sort.
  const auto repeated = at::randint(0, 3, {60}, at::kLong);
  expect_route_matches(repeated, 4, 2, -1, "duplicates");
}

TEST(Kernels_MoeRoute_Cpu, CapacityKeepsTheFirstRoutingsAsWithinCapacity) {
  at::manual_seed(2);
  for (const auto& c : route_cases()) {
    const auto chosen = topk_choices(c.tokens, c.experts, c.k, /*unused=*/0);
    const int64_t even = c.tokens * c.k / c.experts;
    for (const int64_t capacity : {int64_t{0}, int64_t{1}, even / 2, even, c.tokens * c.k}) {
      expect_route_matches(chosen, c.experts, c.k, capacity,
                           c.name + " capacity " + std::to_string(capacity));
    }
  }
  // The expert capacity the layer computes, on a skewed routing (expert 0 taken by most tokens).
  auto chosen = at::randint(0, 8, {64, 2}, at::kLong);
  chosen.select(1, 0).masked_fill_(at::rand({64}) < 0.7, 0);
  chosen.select(1, 1).clamp_min_(1);
  const d9d::model::MoeOptions options{.hidden_size = 4,
                                       .num_experts = 8,
                                       .top_k = 2,
                                       .intermediate_size = 4,
                                       .capacity_factor = 1.25};
  expect_route_matches(chosen.reshape({-1}), 8, 2, d9d::model::expert_capacity(options, 64),
                       "skewed, capacity factor 1.25");
}

TEST(Kernels_MoeRoute_Cpu, NoTokens) {
  const auto r = d9d::kernels::moe_route_indices(at::empty({0}, at::kLong), 3, 2, 5);
  EXPECT_EQ(r.order.numel(), 0);
  EXPECT_EQ(r.position.sizes(), (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(at::equal(r.counts, at::zeros({3}, at::kLong)));
  EXPECT_TRUE(at::equal(r.kept_counts, at::zeros({3}, at::kLong)));
}

TEST(Kernels_MoeRoute_Cpu, BadArgumentsAreNamed) {
  using d9d::testing::error_of;
  EXPECT_THAT(error_of<c10::Error>([] {
                (void)d9d::kernels::moe_route_indices(at::zeros({4}, at::kInt), 2, 1, -1);
              }),
              HasSubstr("chosen must be int64"));
  EXPECT_THAT(error_of<c10::Error>([] {
                (void)d9d::kernels::moe_route_indices(at::zeros({5}, at::kLong), 2, 2, -1);
              }),
              HasSubstr("not a multiple of top_k = 2"));
  EXPECT_THAT(error_of<c10::Error>([] {
                (void)d9d::kernels::moe_route_indices(longs({0, 3}), 3, 1, -1);
              }),
              HasSubstr("chosen[1] = 3 is not an expert in [0, 3)"));
  EXPECT_THAT(error_of<c10::Error>([] {
                (void)d9d::kernels::moe_route_indices(at::zeros({2}, at::kLong), 0, 1, -1);
              }),
              HasSubstr("num_experts = 0 must be >= 1"));
}

// One routing of `tokens` tokens with its ATen composition, for the row ops.
struct Routed {
  d9d::kernels::MoeRouting r;
  Composition c;
  int64_t kept = 0;
  at::Tensor token;  // r.token's kept part
};

Routed routed(int64_t tokens, int64_t experts, int64_t k, int64_t capacity) {
  const auto chosen = topk_choices(tokens, experts, k, /*unused=*/experts - 1);
  Routed out{.r = d9d::kernels::moe_route_indices(chosen, experts, k, capacity),
             .c = composition(chosen, experts, k, capacity),
             .kept = 0,
             .token = at::Tensor()};
  out.kept = out.c.order.numel();
  out.token = out.r.token.narrow(0, 0, out.kept);
  return out;
}

// The routings the row tests run: dropless and with a capacity, top_k 1 and 2+.
std::vector<std::tuple<int64_t, int64_t, std::string>> row_cases() {
  return {{1, -1, "k1 dropless"},  {2, -1, "k2 dropless"},  {3, -1, "k3 dropless"},
          {1, 3, "k1 capacity 3"}, {2, 4, "k2 capacity 4"}, {3, 0, "k3 capacity 0"}};
}

TEST(Kernels_MoePermute_Cpu, RowsAndGradientEqualIndexSelectBitForBit) {
  at::manual_seed(3);
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const auto& [k, capacity, name] : row_cases()) {
      const auto rt = routed(19, 5, k, capacity);
      const auto x = at::randn({19, 12}, dtype).requires_grad_(true);
      const auto rows = d9d::kernels::moe_permute(x, rt.token, rt.r.position);
      const auto want = x.index_select(0, rt.c.token);
      EXPECT_TRUE(at::equal(rows, want)) << name << " " << dtype;
      const auto grad = at::randn_like(want);
      const auto dx = torch::autograd::grad({rows}, {x}, {grad})[0];
      const auto dx_want = torch::autograd::grad({want}, {x}, {grad})[0];
      EXPECT_TRUE(at::equal(dx, dx_want)) << name << " " << dtype;
    }
  }
}

TEST(Kernels_MoeUnpermute_Cpu, SumsAndGradientsEqualIndexAddBitForBit) {
  at::manual_seed(4);
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-14;
    for (const auto& [k, capacity, name] : row_cases()) {
      const auto rt = routed(21, 6, k, capacity);
      const auto outputs = at::randn({rt.kept, 10}, dtype).requires_grad_(true);
      const auto weights = at::rand({21, k}, dtype).requires_grad_(true);
      const auto y = d9d::kernels::moe_unpermute(outputs, weights, rt.r.position);
      const auto sorted_weights = weights.reshape({-1}).index_select(0, rt.c.order);
      const auto want = at::zeros({21, 10}, dtype)
                            .index_add(0, rt.c.token, outputs * sorted_weights.unsqueeze(1));
      EXPECT_TRUE(at::equal(y, want)) << name << " " << dtype;
      const auto dy = at::randn_like(want);
      const auto got = torch::autograd::grad({y}, {outputs, weights}, {dy});
      const auto expected = torch::autograd::grad({want}, {outputs, weights}, {dy});
      EXPECT_TRUE(at::equal(got[0], expected[0])) << name << " " << dtype << " d outputs";
      EXPECT_TRUE(at::allclose(got[1], expected[1], tol, tol)) << name << " " << dtype << " d w";
      // A dropped pair's weight gets exactly zero.
      const auto dropped = rt.r.position.lt(0);
      EXPECT_TRUE(at::equal(got[1].masked_select(dropped),
                            at::zeros({dropped.sum().item<int64_t>()}, dtype)))
          << name;
    }
  }
}

// Central differences in float64: exact up to rounding for these (bi)linear maps.
at::Tensor numeric_gradient(const std::function<at::Tensor(const at::Tensor&)>& f,
                            const at::Tensor& at_point, const at::Tensor& dy) {
  const double eps = 1e-6;
  auto gradient = at::zeros_like(at_point);
  auto point = at_point.detach().clone();
  auto flat = point.view({-1});
  auto out = gradient.view({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double original = flat[i].item<double>();
    flat[i] = original + eps;
    const double plus = (f(point) * dy).sum().item<double>();
    flat[i] = original - eps;
    const double minus = (f(point) * dy).sum().item<double>();
    flat[i] = original;
    out[i] = (plus - minus) / (2 * eps);
  }
  return gradient;
}

TEST(Kernels_MoePermute_Cpu, GradientsEqualCentralDifferencesInDouble) {
  at::manual_seed(5);
  const auto rt = routed(7, 4, 2, 3);  // capacity 3: some pairs dropped
  ASSERT_LT(rt.kept, 14);
  const auto x = at::randn({7, 5}, at::kDouble).requires_grad_(true);
  const auto outputs = at::randn({rt.kept, 5}, at::kDouble).requires_grad_(true);
  const auto weights = at::rand({7, 2}, at::kDouble).requires_grad_(true);
  const auto& position = rt.r.position;
  const auto permute = [&](const at::Tensor& v) {
    return d9d::kernels::moe_permute(v, rt.token, position);
  };
  const auto dr = at::randn({rt.kept, 5}, at::kDouble);
  EXPECT_TRUE(at::allclose(torch::autograd::grad({permute(x)}, {x}, {dr})[0],
                           numeric_gradient(permute, x, dr), 1e-8, 1e-8));
  const auto dy = at::randn({7, 5}, at::kDouble);
  const auto y = d9d::kernels::moe_unpermute(outputs, weights, position);
  const auto grads = torch::autograd::grad({y}, {outputs, weights}, {dy});
  const auto by_outputs = [&](const at::Tensor& v) {
    return d9d::kernels::moe_unpermute(v, weights.detach(), position);
  };
  const auto by_weights = [&](const at::Tensor& v) {
    return d9d::kernels::moe_unpermute(outputs.detach(), v, position);
  };
  EXPECT_TRUE(at::allclose(grads[0], numeric_gradient(by_outputs, outputs, dy), 1e-8, 1e-8));
  EXPECT_TRUE(at::allclose(grads[1], numeric_gradient(by_weights, weights, dy), 1e-8, 1e-8));
}

// bfloat16 / float16: the sums are taken in float and rounded once, i.e. the float kernel on the
// widened inputs, rounded.
TEST(Kernels_MoePermute_Cpu, LowPrecisionRoundsOnceFromFloat) {
  at::manual_seed(6);
  const auto rt = routed(33, 8, 4, -1);
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto outputs = at::randn({rt.kept, 24}).to(dtype);
    const auto weights = at::rand({33, 4}).to(dtype);
    const auto& position = rt.r.position;
    EXPECT_TRUE(at::equal(d9d::kernels::moe_unpermute_forward(outputs, weights, position),
                          d9d::kernels::moe_unpermute_forward(outputs.to(at::kFloat),
                                                              weights.to(at::kFloat), position)
                              .to(dtype)))
        << dtype;
    EXPECT_TRUE(
        at::equal(d9d::kernels::moe_permute_backward(outputs, position),
                  d9d::kernels::moe_permute_backward(outputs.to(at::kFloat), position).to(dtype)))
        << dtype;
    const auto dy = at::randn({33, 24}).to(dtype);
    const auto [d_outputs, d_weights] =
        d9d::kernels::moe_unpermute_backward(dy, outputs, weights, position);
    const auto [d_outputs_f, d_weights_f] = d9d::kernels::moe_unpermute_backward(
        dy.to(at::kFloat), outputs.to(at::kFloat), weights.to(at::kFloat), position);
    EXPECT_TRUE(at::equal(d_outputs, d_outputs_f.to(dtype))) << dtype;
    EXPECT_TRUE(at::equal(d_weights, d_weights_f.to(dtype))) << dtype;
    EXPECT_TRUE(at::equal(d9d::kernels::moe_permute_forward(outputs, rt.token),
                          outputs.index_select(0, rt.token)));
  }
}

TEST(Kernels_MoePermute_Cpu, NoTokensAndNoKeptRows) {
  const auto empty = d9d::kernels::moe_route_indices(at::empty({0}, at::kLong), 3, 2, -1);
  const auto x = at::randn({0, 4});
  EXPECT_EQ(d9d::kernels::moe_permute(x, empty.token, empty.position).sizes(),
            (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(d9d::kernels::moe_unpermute(x, at::empty({0, 2}), empty.position).sizes(),
            (std::vector<int64_t>{0, 4}));
  // Capacity 0: every pair dropped, every token's sum empty.
  const auto none = d9d::kernels::moe_route_indices(longs({0, 1, 1, 0}), 2, 2, 0);
  const auto y = d9d::kernels::moe_unpermute(at::randn({0, 3}), at::rand({2, 2}), none.position);
  EXPECT_TRUE(at::equal(y, at::zeros({2, 3})));
}

TEST(Kernels_MoePermute_Cpu, BadArgumentsAreNamed) {
  using d9d::testing::error_of;
  const auto r = d9d::kernels::moe_route_indices(longs({0, 1, 1, 0}), 2, 2, -1);
  const auto x = at::randn({2, 3});
  EXPECT_THAT(error_of<c10::Error>([&] { (void)d9d::kernels::moe_permute(x, r.token, r.order); }),
              HasSubstr("position must be a 2-D int64 tensor"));
  EXPECT_THAT(error_of<c10::Error>([&] {
                (void)d9d::kernels::moe_permute(at::randn({3, 3}), r.token, r.position);
              }),
              HasSubstr("position has 2 rows, x has 3 tokens"));
  EXPECT_THAT(error_of<c10::Error>([&] {
                (void)d9d::kernels::moe_permute_forward(x, longs({0, 2}));
              }),
              HasSubstr("token[1] = 2 is not a row of x"));
  const auto outputs = at::randn({4, 3});
  EXPECT_THAT(
      error_of<c10::Error>([&] {
        (void)d9d::kernels::moe_unpermute(outputs, at::rand({2, 2}, at::kDouble), r.position);
      }),
      HasSubstr("weights are Double, outputs Float"));
  EXPECT_THAT(error_of<c10::Error>(
                  [&] { (void)d9d::kernels::moe_unpermute(outputs, at::rand({4}), r.position); }),
              HasSubstr("weights must have position's shape"));
  EXPECT_THAT(
      error_of<c10::Error>([&] {
        (void)d9d::kernels::moe_unpermute(outputs.narrow(0, 0, 2), at::rand({2, 2}), r.position);
      }),
      HasSubstr("is past the 2 permuted rows"));
}

}  // namespace
