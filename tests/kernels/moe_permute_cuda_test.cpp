// d9d::moe_route_indices, d9d::moe_permute and d9d::moe_unpermute on CUDA (GPU machines only;
// ctest label "gpu"): the CUDA kernels against the CPU reference kernels on the same inputs. The
// indices and every row sum must be equal bit for bit (same order and roundings), the weights'
// gradient to rounding (a tree sum on the GPU); routings over many 1024-pair chunks, skewed and
// uniform, dropless and with a capacity, 1 to 4096 experts; rows in every dtype, aligned
// (vectorised) and not; repeated runs identical; and the MoE layer with the kernels against the
// ATen composition on the GPU.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/kernels/moe_permute.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/moe.hpp>

namespace {

class Kernels_MoePermute_Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

// N tokens' top-k distinct experts; `skew` > 0 makes expert 0 (and the low ids) much likelier.
at::Tensor choices(int64_t tokens, int64_t experts, int64_t k, double skew) {
  auto scores = at::rand({tokens, experts}, at::kDouble);
  if (skew > 0) {
    scores = scores - skew * at::arange(experts, at::kDouble) / static_cast<double>(experts);
  }
  return std::get<1>(at::topk(scores, k, -1)).reshape({-1});
}

void expect_same_route(const at::Tensor& chosen, int64_t experts, int64_t k, int64_t capacity,
                       const std::string& what) {
  const auto want = d9d::kernels::moe_route_indices(chosen, experts, k, capacity);
  const auto got = d9d::kernels::moe_route_indices(chosen.cuda(), experts, k, capacity);
  ASSERT_TRUE(got.order.is_cuda()) << what;
  EXPECT_TRUE(at::equal(got.order.cpu(), want.order)) << what << ": order";
  EXPECT_TRUE(at::equal(got.token.cpu(), want.token)) << what << ": token";
  EXPECT_TRUE(at::equal(got.position.cpu(), want.position)) << what << ": position";
  EXPECT_TRUE(at::equal(got.counts.cpu(), want.counts)) << what << ": counts";
  EXPECT_TRUE(at::equal(got.kept_counts.cpu(), want.kept_counts)) << what << ": kept counts";
}

TEST_F(Kernels_MoePermute_Cuda, RouteIndicesEqualTheCpuReference) {
  at::manual_seed(1);
  struct Case {
    int64_t tokens, experts, k;
  };
  // Qwen3-30B-A3B's 8192 x top 8 of 128 (64 chunks), a ragged last chunk, top 1, one expert,
  // more experts than fit the default shared memory of the placement kernel.
  for (const auto& c : {Case{8192, 128, 8}, Case{1000, 60, 3}, Case{777, 16, 1}, Case{300, 1, 1},
                        Case{2000, 4096, 4}, Case{5, 7, 2}}) {
    for (const double skew : {0.0, 4.0}) {
      const auto chosen = choices(c.tokens, c.experts, c.k, skew);
      const int64_t even = c.tokens * c.k / c.experts;
      for (const int64_t capacity : {int64_t{-1}, int64_t{0}, even, 2 * even + 1}) {
        expect_same_route(chosen, c.experts, c.k, capacity,
                          std::to_string(c.tokens) + " x " + std::to_string(c.k) + " of " +
                              std::to_string(c.experts) + " skew " + std::to_string(skew) +
                              " capacity " + std::to_string(capacity));
      }
    }
  }
  // Duplicate experts within a token, and nothing at all.
  expect_same_route(at::randint(0, 3, {4096}, at::kLong), 5, 4, 100, "duplicates");
  expect_same_route(at::empty({0}, at::kLong), 4, 2, -1, "no tokens");
}

TEST_F(Kernels_MoePermute_Cuda, RowsEqualTheCpuReferenceBitForBit) {
  at::manual_seed(2);
  const auto chosen = choices(513, 16, 4, 2.0);
  for (const int64_t capacity : {int64_t{-1}, int64_t{100}}) {
    const auto route = d9d::kernels::moe_route_indices(chosen, 16, 4, capacity);
    const int64_t kept = route.kept_counts.sum().item<int64_t>();
    const auto token = route.token.narrow(0, 0, kept);
    const auto& position = route.position;
    for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const int64_t hidden : {int64_t{256}, int64_t{13}}) {  // vectorised, and not
        const std::string what = std::string(c10::toString(dtype)) + " hidden " +
                                 std::to_string(hidden) + " capacity " + std::to_string(capacity);
        const auto x = at::randn({513, hidden}).to(dtype);
        const auto outputs = at::randn({kept, hidden}).to(dtype);
        const auto weights = at::rand({513, 4}).to(dtype);
        const auto dy = at::randn({513, hidden}).to(dtype);
        EXPECT_TRUE(at::equal(d9d::kernels::moe_permute_forward(x.cuda(), token.cuda()).cpu(),
                              d9d::kernels::moe_permute_forward(x, token)))
            << what;
        EXPECT_TRUE(
            at::equal(d9d::kernels::moe_permute_backward(outputs.cuda(), position.cuda()).cpu(),
                      d9d::kernels::moe_permute_backward(outputs, position)))
            << what;
        EXPECT_TRUE(at::equal(
            d9d::kernels::moe_unpermute_forward(outputs.cuda(), weights.cuda(), position.cuda())
                .cpu(),
            d9d::kernels::moe_unpermute_forward(outputs, weights, position)))
            << what;
        const auto [d_outputs, d_weights] = d9d::kernels::moe_unpermute_backward(
            dy.cuda(), outputs.cuda(), weights.cuda(), position.cuda());
        const auto [d_outputs_want, d_weights_want] =
            d9d::kernels::moe_unpermute_backward(dy, outputs, weights, position);
        EXPECT_TRUE(at::equal(d_outputs.cpu(), d_outputs_want)) << what;
        const double tol = dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-5 : 1.0 / 64;
        EXPECT_TRUE(at::allclose(d_weights.cpu().to(at::kDouble), d_weights_want.to(at::kDouble),
                                 tol, tol * hidden))
            << what;
      }
    }
  }
}

TEST_F(Kernels_MoePermute_Cuda, RepeatedRunsAreIdentical) {
  at::manual_seed(3);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const auto chosen = choices(8192, 128, 8, 3.0).cuda();
  const auto route = d9d::kernels::moe_route_indices(chosen, 128, 8, -1);
  const auto outputs = at::randn({int64_t{8192} * 8, 512}, options.dtype(at::kBFloat16));
  const auto weights = at::rand({8192, 8}, options.dtype(at::kBFloat16));
  const auto dy = at::randn({8192, 512}, options.dtype(at::kBFloat16));
  const auto y = d9d::kernels::moe_unpermute_forward(outputs, weights, route.position);
  const auto dx = d9d::kernels::moe_permute_backward(outputs, route.position);
  const auto [d_outputs, d_weights] =
      d9d::kernels::moe_unpermute_backward(dy, outputs, weights, route.position);
  for (int run = 0; run < 3; ++run) {
    const auto again = d9d::kernels::moe_route_indices(chosen, 128, 8, -1);
    EXPECT_TRUE(at::equal(again.order, route.order));
    EXPECT_TRUE(at::equal(again.position, route.position));
    EXPECT_TRUE(
        at::equal(d9d::kernels::moe_unpermute_forward(outputs, weights, route.position), y));
    EXPECT_TRUE(at::equal(d9d::kernels::moe_permute_backward(outputs, route.position), dx));
    const auto [o2, w2] =
        d9d::kernels::moe_unpermute_backward(dy, outputs, weights, route.position);
    EXPECT_TRUE(at::equal(o2, d_outputs));
    EXPECT_TRUE(at::equal(w2, d_weights));
  }
}

TEST_F(Kernels_MoePermute_Cuda, AutogradThroughTheOps) {
  at::manual_seed(4);
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const auto chosen = choices(64, 8, 2, 0.0);
  const auto route = d9d::kernels::moe_route_indices(chosen.cuda(), 8, 2, 12);
  const int64_t kept = route.kept_counts.sum().item<int64_t>();
  const auto token = route.token.narrow(0, 0, kept);
  const auto x = at::randn({64, 32}, options).requires_grad_(true);
  const auto weights = at::rand({64, 2}, options).requires_grad_(true);
  const auto rows = d9d::kernels::moe_permute(x, token, route.position);
  const auto y = d9d::kernels::moe_unpermute(rows * 2, weights, route.position);
  const auto dy = at::randn({64, 32}, options);
  const auto grads = torch::autograd::grad({y}, {x, weights}, {dy});
  // The ATen composition on the same device.
  const auto order = route.order.narrow(0, 0, kept);
  const auto xr = x.detach().clone().requires_grad_(true);
  const auto wr = weights.detach().clone().requires_grad_(true);
  const auto want = at::zeros({64, 32}, options)
                        .index_add(0, token,
                                   xr.index_select(0, token) * 2 *
                                       wr.reshape({-1}).index_select(0, order).unsqueeze(1));
  const auto grads_want = torch::autograd::grad({want}, {xr, wr}, {dy});
  EXPECT_TRUE(at::allclose(y, want, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(grads[0], grads_want[0], 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(grads[1], grads_want[1], 1e-4, 1e-4));
}

// The MoE layer on the GPU with the kernels (d9d::model::fused_kernels()) and with the ATen
// composition: the same output and gradients, dropless and with a capacity factor.
TEST_F(Kernels_MoePermute_Cuda, MoeLayerEqualsTheAtenComposition) {
  for (const double factor : {0.0, 1.0}) {
    at::manual_seed(5);
    d9d::model::MoeLayer layer(d9d::model::MoeOptions{.hidden_size = 64,
                                                      .num_experts = 16,
                                                      .top_k = 4,
                                                      .intermediate_size = 32,
                                                      .norm_topk_prob = true,
                                                      .capacity_factor = factor},
                               0);
    layer->to(at::kCUDA);
    const auto x = at::randn({4, 128, 64}, at::TensorOptions().device(at::kCUDA));
    std::vector<at::Tensor> outs;
    std::vector<std::vector<at::Tensor>> grads;
    for (const bool fused : {true, false}) {
      d9d::model::set_fused_kernels(fused);
      layer->zero_grad();
      const auto xi = x.clone().requires_grad_(true);
      const auto y = layer(xi);
      (y * y).sum().backward();
      outs.push_back(y.detach());
      grads.push_back({xi.grad(), layer->gate->weight.grad(), layer->experts->down_proj.grad()});
    }
    d9d::model::set_fused_kernels(true);
    EXPECT_TRUE(at::allclose(outs[0], outs[1], 1e-5, 1e-6)) << "factor " << factor;
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_TRUE(at::allclose(grads[0][i], grads[1][i], 1e-4, 1e-5))
          << "factor " << factor << " gradient " << i;
    }
  }
}

}  // namespace
