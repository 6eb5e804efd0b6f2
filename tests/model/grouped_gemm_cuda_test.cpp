// The routed experts' grouped GEMM on CUDA (GPU machines only; ctest label "gpu"): at::_grouped_mm
// in bfloat16, as GroupedExperts runs it there (GroupedGemm::automatic), against the loop over the
// segments in float64 on the CPU from the same bfloat16 values: outputs and the gradients of x and
// of the experts' weights, with segments of uneven sizes, an empty one and one of a single row.
// And LoRA on the experts (d9d::peft::ExpertLoraAdapter) in bfloat16 on CUDA, at a rank the
// grouped GEMM takes (8) and one it does not (4: the loop), against the float64 CPU module.
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/model/moe.hpp>
#include <d9d/peft/lora.hpp>

namespace {

using d9d::model::GroupedGemm;

// Largest difference relative to the largest value of `want`.
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const auto w = want.to(at::kDouble);
  return (got.cpu().to(at::kDouble) - w).abs().max().item<double>() / w.abs().max().item<double>();
}

TEST(Model_GroupedGemm_Cuda, Bfloat16GroupedMmEqualsTheFloat64Loop) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  at::manual_seed(5);
  const std::vector<int64_t> counts = {37, 0, 128, 1, 64, 19, 200, 63};  // 512 rows, 8 experts
  const int64_t rows = 512;
  const int64_t in = 256;
  const int64_t out = 384;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const auto x = at::randn({rows, in}, bf16);
  const auto w = at::randn({8, out, in}, bf16) / 16.0;
  const auto upstream = at::randn({rows, out}, bf16);

  const auto xg = x.clone().requires_grad_(true);
  const auto wg = w.clone().requires_grad_(true);
  const auto got = d9d::model::grouped_linear(xg, wg, counts, GroupedGemm::automatic);
  got.backward(upstream);

  const auto xr = x.cpu().to(at::kDouble).requires_grad_(true);
  const auto wr = w.cpu().to(at::kDouble).requires_grad_(true);
  const auto want = d9d::model::grouped_linear(xr, wr, counts, GroupedGemm::loop);
  want.backward(upstream.cpu().to(at::kDouble));

  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(got.is_cuda());
  // bfloat16 keeps 8 significant bits: one rounding of each result, float32 accumulation.
  EXPECT_LT(relative_error(got, want), 1e-2);
  EXPECT_LT(relative_error(xg.grad(), xr.grad()), 1e-2);
  EXPECT_LT(relative_error(wg.grad(), wr.grad()), 1e-2);
  EXPECT_TRUE(at::equal(wg.grad()[1].cpu(), at::zeros({out, in}, at::kBFloat16)))
      << "the empty segment's expert gets a zero gradient";
  // And the same values from the explicit grouped_mm path (what automatic chose).
  const auto explicit_mm = d9d::model::grouped_linear(x, w, counts, GroupedGemm::grouped_mm);
  EXPECT_TRUE(at::equal(explicit_mm, got.detach()));
}

TEST(Model_GroupedGemm_Cuda, ExpertLoraInBfloat16EqualsTheFloat64Module) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  for (const int64_t rank : {8, 4}) {
    at::manual_seed(7);
    const d9d::model::MoeOptions options{
        .hidden_size = 256, .num_experts = 8, .top_k = 2, .intermediate_size = 128};
    d9d::model::GroupedExperts reference(options);
    reference->to(at::kDouble);
    for (std::size_t p = 0; p < 3; ++p) {
      reference->adapters.at(p) = std::make_shared<d9d::peft::ExpertLoraAdapter>(
          *reference, p, d9d::peft::LoraOptions{.rank = rank, .alpha = 16.0}, 3, "experts");
      const at::NoGradGuard no_grad;
      dynamic_cast<d9d::peft::ExpertLoraAdapter&>(*reference->adapters.at(p))
          .lora_B.normal_(0.0, 0.05);
    }
    // The same values in bfloat16 on the GPU (the module copied, its adapters pointed at them).
    d9d::model::GroupedExperts cuda(options);
    cuda->to(at::kDouble);
    for (std::size_t p = 0; p < 3; ++p) {
      cuda->adapters.at(p) = std::make_shared<d9d::peft::ExpertLoraAdapter>(
          *cuda, p, d9d::peft::LoraOptions{.rank = rank, .alpha = 16.0}, 3, "experts");
    }
    {
      const at::NoGradGuard no_grad;
      auto from = reference->named_parameters();
      for (auto& item : cuda->named_parameters()) {
        item.value().copy_(from[item.key()].to(at::kBFloat16).to(at::kDouble));
        reference->named_parameters()[item.key()].copy_(item.value());
      }
    }
    cuda->to(at::kCUDA, at::kBFloat16);
    const std::vector<int64_t> counts = {37, 0, 128, 1, 64, 19, 200, 63};
    const auto x = at::randn({512, 256}, at::TensorOptions().dtype(at::kBFloat16));
    const auto got = cuda->forward(x.to(at::kCUDA), counts);
    const auto want = reference->forward(x.to(at::kDouble), counts);
    const auto without = [&] {
      const at::NoGradGuard no_grad;
      auto saved = reference->adapters;
      reference->adapters = {};
      auto out = reference->forward(x.to(at::kDouble), counts);
      reference->adapters = saved;
      return out;
    }();
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    EXPECT_LT(relative_error(got, want), 2e-2) << "rank " << rank;
    EXPECT_GT(relative_error(without, want), 1e-1) << "rank " << rank << ": the adapters act";
  }
}

}  // namespace
