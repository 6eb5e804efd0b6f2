// The linear layer's weight gradient under bf16 mixed precision on CUDA (GPU machines only; ctest
// label "gpu"): a float32 weight, bfloat16 autocast, three microbatches, the gradient accumulated
// into .grad by the autograd engine (B; without a queue too, and with the step's weight-cast cache)
// and by a deferred d9d::WeightGradQueue (W). The GEMM writes
// the float32 product itself (src/model/split_linear.cpp), so .grad equals the float64 sum of the
// bfloat16 operands' products to float32 accumulation — a bfloat16 product rounded before the add
// would be ~1e-3 off.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/model/layers.hpp>

namespace {

TEST(Model_Linear_Cuda, Bf16MixedWeightGradientIsTheFloat32Product) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  constexpr int kMicrobatches = 3;
  at::manual_seed(11);
  std::vector<at::Tensor> xs;
  std::vector<at::Tensor> ups;
  for (int m = 0; m < kMicrobatches; ++m) {
    // Values bfloat16 holds exactly, so the reference sees the GEMM's operands.
    xs.push_back(at::randn({2, 96, 256}, at::kCUDA).to(at::kBFloat16).to(at::kFloat));
    ups.push_back(at::randn({2, 96, 384}, at::kCUDA).to(at::kBFloat16));
  }
  auto want = at::zeros({384, 256}, at::kDouble);
  for (int m = 0; m < kMicrobatches; ++m) {
    want += ups[m]
                .to(at::kDouble)
                .cpu()
                .reshape({-1, 384})
                .t()
                .mm(xs[m].to(at::kDouble).cpu().reshape({-1, 256}));
  }
  enum class Mode { autograd, cached, deferred };
  for (const auto mode : {Mode::autograd, Mode::cached, Mode::deferred}) {
    const bool deferred = mode == Mode::deferred;
    at::manual_seed(12);
    d9d::model::Linear layer(256, 384);
    layer->to(at::kCUDA);
    ASSERT_EQ(layer->weight.scalar_type(), at::kFloat);
    d9d::WeightGradQueue queue;
    const d9d::detail::WeightCastScope casts(mode == Mode::cached);
    for (int m = 0; m < kMicrobatches; ++m) {
      at::Tensor y;
      {
        const d9d::detail::AutocastScope autocast(true, c10::DeviceType::CUDA);
        if (deferred) {
          const d9d::RecordWeightGrads record(queue);
          y = layer(xs[m]);
        } else {
          y = layer(xs[m]);
        }
      }
      ASSERT_EQ(y.scalar_type(), at::kBFloat16);
      if (deferred) {
        const d9d::DeferWeightGrads defer(queue);
        y.backward(ups[m]);
      } else {
        y.backward(ups[m]);
      }
    }
    if (deferred) {
      EXPECT_FALSE(layer->weight.grad().defined()) << "the weight gradient waits for W";
      queue.drain();
    }
    const auto& grad = layer->weight.grad();
    ASSERT_TRUE(grad.defined());
    EXPECT_EQ(grad.scalar_type(), at::kFloat);
    const double error = (grad.cpu().to(at::kDouble) - want).abs().max().item<double>() /
                         want.abs().max().item<double>();
    EXPECT_LT(error, 1e-5) << (deferred               ? "deferred (W)"
                               : mode == Mode::cached ? "autograd (B), casts cached"
                                                      : "autograd (B)");
    if (mode == Mode::cached) {
      EXPECT_EQ(d9d::detail::cached_weight_casts(), 1U);
    }
  }
}

TEST(Model_FanOutLinear_Cuda, Bf16MixedGradientsAreTheFloat32Products) {
  // Two layers reading one x as one node (d9d::model::fan_out_linear), float32 weights, bfloat16
  // autocast, at once (B) and deferred (W): each weight's .grad is the float32 product as for one
  // Linear, x's gradient the two products summed by the GEMMs (bfloat16 output: its rounding).
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  at::manual_seed(13);
  const auto x0 = at::randn({2, 96, 256}, at::kCUDA).to(at::kBFloat16).to(at::kFloat);
  const std::vector<at::Tensor> grads{at::randn({2, 96, 384}, at::kCUDA).to(at::kBFloat16),
                                      at::randn({2, 96, 128}, at::kCUDA).to(at::kBFloat16)};
  const auto rows = x0.to(at::kDouble).cpu().reshape({-1, 256});
  for (const bool deferred : {false, true}) {
    at::manual_seed(14);
    d9d::model::Linear first(256, 384);
    d9d::model::Linear second(256, 128);
    first->to(at::kCUDA);
    second->to(at::kCUDA);
    const auto x = x0.clone().requires_grad_();
    d9d::WeightGradQueue queue;
    std::vector<at::Tensor> out;
    {
      const d9d::detail::AutocastScope autocast(true, c10::DeviceType::CUDA);
      const d9d::RecordWeightGrads record(queue);
      out = d9d::model::fan_out_linear(x, {first.get(), second.get()});
    }
    ASSERT_EQ(out.size(), 2U);
    EXPECT_EQ(out[0].scalar_type(), at::kBFloat16);
    {
      const d9d::DeferWeightGrads defer(queue);
      torch::autograd::backward(out, grads);
    }
    queue.drain();
    auto want_x = at::zeros({int64_t{2} * 96, 256}, at::kDouble);
    const std::vector<d9d::model::Linear*> layers{&first, &second};
    for (size_t i = 0; i < 2; ++i) {
      const auto& weight = (*layers[i])->weight;
      const auto g = grads[i].to(at::kDouble).cpu().reshape({-1, weight.size(0)});
      const auto want_w = g.t().mm(rows);
      ASSERT_TRUE(weight.grad().defined()) << i;
      EXPECT_EQ(weight.grad().scalar_type(), at::kFloat);
      const double error =
          (weight.grad().cpu().to(at::kDouble) - want_w).abs().max().item<double>() /
          want_w.abs().max().item<double>();
      EXPECT_LT(error, 1e-5) << "weight " << i << (deferred ? ", deferred" : "");
      want_x += g.mm(weight.detach().to(at::kBFloat16).to(at::kDouble).cpu());
    }
    ASSERT_TRUE(x.grad().defined());
    const double error =
        (x.grad().cpu().to(at::kDouble).reshape({-1, 256}) - want_x).abs().max().item<double>() /
        want_x.abs().max().item<double>();
    EXPECT_LT(error, 1e-2) << (deferred ? "deferred" : "at once");
  }
}

}  // namespace
