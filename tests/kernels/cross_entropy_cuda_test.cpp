// d9d::cross_entropy_rows_ on CUDA (GPU machines only; ctest label "gpu"): against the CPU
// reference kernel on the same logits, in bfloat16, float and double, with a vocabulary the
// vector loads divide (151,936, Qwen3's) and one they do not (1,001), ignored rows included.
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/kernels/cross_entropy.hpp>

namespace {

TEST(Kernels_CrossEntropyRows_Cuda, MatchesTheCpuReference) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  struct Case {
    at::ScalarType dtype;
    double loss_tol;  // float32 accumulation order and fast exp
    double grad_tol;  // one rounding of the dtype, or the float sum's error (below)
  };
  // float: each thread sums ~300 terms, then a tree of 512: the log-sum-exp is off by at most
  // ~300 float roundings (2e-5 relative), and every probability by as much.
  for (const Case c : std::vector<Case>{{at::kBFloat16, 1e-4, 1.0 / 64},
                                        {at::kFloat, 1e-4, 1e-4},
                                        {at::kDouble, 1e-12, 1e-12}}) {
    for (const int64_t vocab : {int64_t{151936}, int64_t{1001}}) {
      at::manual_seed(5);
      const auto logits = (at::randn({19, vocab}) * 3).to(c.dtype);
      auto labels = at::randint(0, vocab, {19}, at::kLong);
      labels[4] = -100;
      auto cpu = logits.clone();
      auto gpu = logits.cuda();
      const auto loss_cpu = d9d::kernels::cross_entropy_rows_(cpu, labels, -100);
      const auto loss_gpu = d9d::kernels::cross_entropy_rows_(gpu, labels.cuda(), -100).cpu();
      EXPECT_TRUE(at::allclose(loss_cpu, loss_gpu, c.loss_tol, c.loss_tol))
          << c.dtype << " vocab " << vocab << ": loss max diff "
          << (loss_cpu - loss_gpu).abs().max().item<double>();
      const auto a = cpu.to(at::kDouble);
      const auto b = gpu.cpu().to(at::kDouble);
      EXPECT_TRUE(at::allclose(a, b, c.grad_tol, c.grad_tol * 1e-3))
          << c.dtype << " vocab " << vocab << ": gradient max diff "
          << (a - b).abs().max().item<double>();
      EXPECT_EQ(b[4].abs().sum().item<double>(), 0.0);
    }
  }
}

}  // namespace
