// d9d::adamw_stochastic_ and d9d::copy_stochastic_ on CUDA (GPU machines only; ctest label
// "gpu"): the CUDA kernels against the CPU reference kernels on the same inputs and seeds. The
// copy is bit-identical; AdamW's float32 arithmetic may differ by contraction (fused multiply-add),
// so a parameter may land on the other bfloat16 neighbour where the exact value sits at a rounding
// threshold: at most one step apart, and rarely. Aligned (vectorised) and unaligned (scalar) lists,
// several chunks per tensor with tails.
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/kernels/stochastic.hpp>

#include "tests/kernels/cuda_views.hpp"

namespace {

class Kernels_Stochastic_Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_F(Kernels_Stochastic_Cuda, CopyIsBitIdenticalToTheCpuKernel) {
  const auto src = at::randn({3, 100003}, at::kFloat) * 10;
  auto cpu = at::empty(src.sizes(), at::kBFloat16);
  auto gpu = at::empty(src.sizes(), at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  d9d::kernels::copy_stochastic(cpu, src, 99);
  d9d::kernels::copy_stochastic(gpu, src.cuda(), 99);
  EXPECT_TRUE(at::equal(cpu.view(at::kShort), gpu.cpu().view(at::kShort)));
}

TEST_F(Kernels_Stochastic_Cuda, AdamWMatchesTheCpuKernel) {
  const d9d::kernels::AdamWStep step{
      .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 5};
  for (const bool aligned : {true, false}) {
    for (const auto grad_type : {at::kBFloat16, at::kFloat}) {
      for (const auto state_type : {at::kFloat, at::kBFloat16}) {
        at::manual_seed(17);
        // Sizes across the 65536-element chunks, with tails; unaligned: views one element in.
        const std::vector<int64_t> sizes = {65536 * 3 + 5, 1000, 7, 300000};
        std::vector<at::Tensor> p_cpu, g_cpu, m_cpu, v_cpu, p_gpu, g_gpu, m_gpu, v_gpu;
        const auto make = [&](int64_t n, at::ScalarType type, double scale, bool positive) {
          const int64_t skip = aligned ? 0 : 1;
          auto base = positive ? at::rand({n + skip}) : at::randn({n + skip});
          auto t = (base * scale).to(type).narrow(0, skip, n);
          return t;
        };
        for (const auto n : sizes) {
          p_cpu.push_back(make(n, at::kBFloat16, 1.0, false));
          g_cpu.push_back(make(n, grad_type, 1e-2, false));
          m_cpu.push_back(make(n, state_type, 1e-3, false));
          v_cpu.push_back(make(n, state_type, 1e-5, true));
        }
        // Keep the misalignment on the device: views one element into their allocations.
        const int64_t skip = aligned ? 0 : 1;
        p_gpu = d9d::testing::to_cuda_views(p_cpu, skip);
        g_gpu = d9d::testing::to_cuda_views(g_cpu, skip);
        m_gpu = d9d::testing::to_cuda_views(m_cpu, skip);
        v_gpu = d9d::testing::to_cuda_views(v_cpu, skip);
        d9d::kernels::adamw_stochastic(p_cpu, g_cpu, m_cpu, v_cpu, step, 1234);
        d9d::kernels::adamw_stochastic(p_gpu, g_gpu, m_gpu, v_gpu, step, 1234);
        int64_t differ = 0;
        int64_t total = 0;
        for (std::size_t t = 0; t < sizes.size(); ++t) {
          const auto a = p_cpu[t].to(at::kDouble);
          const auto b = p_gpu[t].cpu().to(at::kDouble);
          const auto bf16_step = at::pow(2.0, at::floor(at::log2(a.abs().clamp_min(1e-30))) - 7);
          EXPECT_TRUE(((a - b).abs() <= bf16_step * 1.001).all().item<bool>())
              << "tensor " << t << ": more than one bfloat16 step apart";
          differ += (a != b).sum().item<int64_t>();
          total += a.numel();
          // Moments: float32 contraction differences (a few ulps of the inputs' terms, which may
          // cancel: an absolute bound at the inputs' scale), or one bfloat16 rounding.
          const double rtol = state_type == at::kFloat ? 1e-6 : 1.0 / 64;
          const auto close = [&](const at::Tensor& x, const at::Tensor& y, double atol) {
            const auto a64 = x.to(at::kDouble);
            const auto b64 = y.cpu().to(at::kDouble);
            const bool ok = at::allclose(a64, b64, rtol, atol);
            EXPECT_TRUE(ok) << "max diff " << (a64 - b64).abs().max().item<double>();
            return ok;
          };
          EXPECT_TRUE(close(m_cpu[t], m_gpu[t], 1e-9)) << "exp_avg " << t;
          EXPECT_TRUE(close(v_cpu[t], v_gpu[t], 1e-11)) << "exp_avg_sq " << t;
        }
        // A differing neighbour needs the float32 results to straddle a rounding threshold.
        EXPECT_LT(static_cast<double>(differ), 1e-3 * static_cast<double>(total))
            << differ << " of " << total << " parameters differ (aligned " << aligned << ")";
      }
    }
  }
}

TEST_F(Kernels_Stochastic_Cuda, SmallUpdatesAreKeptOnAverage) {
  constexpr int64_t kN = 1 << 22;
  const double ulp_below_one = std::ldexp(1.0, -8);
  const d9d::kernels::AdamWStep step{.lr = 0.3 * ulp_below_one, .eps = 0.0, .step = 1};
  const auto opts = at::TensorOptions().device(at::kCUDA);
  std::vector<at::Tensor> params = {at::ones({kN}, opts.dtype(at::kBFloat16))};
  std::vector<at::Tensor> grads = {at::full({kN}, 0.5, opts.dtype(at::kBFloat16))};
  std::vector<at::Tensor> ms = {at::zeros({kN}, opts.dtype(at::kFloat))};
  std::vector<at::Tensor> vs = {at::zeros({kN}, opts.dtype(at::kFloat))};
  d9d::kernels::adamw_stochastic(params, grads, ms, vs, step, 5);
  const double down = (params[0] < 1.0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(down, 0.3, 6 * std::sqrt(0.21 / kN));
}

}  // namespace
