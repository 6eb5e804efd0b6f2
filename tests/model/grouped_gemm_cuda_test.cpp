// The routed experts' grouped GEMM on CUDA (GPU machines only; ctest label "gpu"): at::_grouped_mm
// in bfloat16, as GroupedExperts runs it there (GroupedGemm::automatic), against the loop over the
// segments in float64 on the CPU from the same bfloat16 values: outputs and the gradients of x and
// of the experts' weights, with segments of uneven sizes, an empty one and one of a single row.
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/model/moe.hpp>

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

}  // namespace
