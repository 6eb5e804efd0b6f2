// d9d::model::context_attention on CUDA (GPU machines only; ctest label "gpu"): a rank's two chunks
// (one rank: chunks 0 and 1 of 2) attended block by block through cuDNN's attention,
// FlashAttention-2 and the composed blocks, in bfloat16 with grouped-query heads, against SDPA over
// the whole sequence in float32 on the same inputs: outputs and the gradients of q, k and v.
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/model/context_parallel.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace {

// Largest difference relative to the largest value of `want`.
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const auto w = want.to(at::kFloat);
  return (got.to(at::kFloat) - w).abs().max().item<double>() / w.abs().max().item<double>();
}

TEST(Model_ContextAttention_Cuda, FlashAndComposedBlocksMatchSdpa) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const auto group = d9d::parallel::detail::make_context_parallel_group(d9d::ProcessGroup(), false);
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::manual_seed(3);
  const auto q = at::randn({2, 16, 512, 128}, options);
  const auto k = at::randn({2, 8, 512, 128}, options);
  const auto v = at::randn({2, 8, 512, 128}, options);
  const auto upstream = at::randn({2, 16, 512, 128}, options);
  const auto qf = q.to(at::kFloat).requires_grad_(true);
  const auto kf = k.to(at::kFloat).requires_grad_(true);
  const auto vf = v.to(at::kFloat).requires_grad_(true);
  const auto want = at::scaled_dot_product_attention(qf, kf, vf, std::nullopt, 0.0, true,
                                                     std::nullopt, /*enable_gqa=*/true);
  (want * upstream.to(at::kFloat)).sum().backward();
  // cuDNN's attention (the default), FlashAttention-2 (cuDNN's SDPA disabled), composed blocks.
  for (const auto& [fused, cudnn] :
       {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
    d9d::model::set_fused_kernels(fused);
    at::globalContext().setSDPUseCuDNN(cudnn);
    const std::string what = !fused ? "composed blocks" : cudnn ? "cuDNN blocks" : "flash blocks";
    const auto ql = q.clone().requires_grad_(true);
    const auto kl = k.clone().requires_grad_(true);
    const auto vl = v.clone().requires_grad_(true);
    const auto got = d9d::model::context_attention(ql, kl, vl, at::Tensor(), *group);
    EXPECT_EQ(got.scalar_type(), at::kBFloat16) << what;
    (got * upstream).sum().backward();
    // bfloat16 inputs and output: a few units of its roundoff (2^-8) over the reference.
    EXPECT_LT(relative_error(got, want), 2e-2) << what;
    EXPECT_LT(relative_error(ql.grad(), qf.grad()), 3e-2) << what;
    EXPECT_LT(relative_error(kl.grad(), kf.grad()), 3e-2) << what;
    EXPECT_LT(relative_error(vl.grad(), vf.grad()), 3e-2) << what;
  }
  d9d::model::set_fused_kernels(true);
  at::globalContext().setSDPUseCuDNN(true);
}

}  // namespace
