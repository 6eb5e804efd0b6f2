// d9d::rms_norm on CUDA (GPU machines only; ctest label "gpu"): the CUDA kernels against the CPU
// reference kernels on the same inputs, forward and backward, fp32 / bf16 / fp16 / fp64.
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/kernels/rms_norm.hpp>

#include "tests/kernels/rms_norm_cases.hpp"

namespace {

using Case = d9d::testing::RmsNormCase;

std::string describe(const at::Tensor& got, const at::Tensor& want) {
  const auto diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
  return "max abs diff " + std::to_string(diff.max().item<double>()) + " (max |want| " +
         std::to_string(want.to(at::kDouble).abs().max().item<double>()) + ")";
}

bool close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol) {
  return at::allclose(got.cpu().to(at::kDouble), want.cpu().to(at::kDouble), rtol, atol);
}

class Kernels_RmsNorm_Cuda : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_P(Kernels_RmsNorm_Cuda, ForwardAndBackwardMatchCpuReference) {
  const auto& c = GetParam();
  at::manual_seed(0);
  const auto x = at::randn(c.shape, at::kDouble).to(c.dtype);
  const auto w = (1.0 + 0.1 * at::randn({c.shape.back()}, at::kDouble)).to(c.weight());
  const auto dy = at::randn(c.shape, at::kDouble).to(c.out());

  const auto [y_cpu, rstd_cpu] = d9d::kernels::rms_norm_forward(x, w, 1e-6, c.out_arg());
  const auto [y_gpu, rstd_gpu] =
      d9d::kernels::rms_norm_forward(x.cuda(), w.cuda(), 1e-6, c.out_arg());
  ASSERT_TRUE(y_gpu.is_cuda());
  EXPECT_EQ(y_gpu.scalar_type(), c.out());
  EXPECT_TRUE(close(y_gpu, y_cpu, c.rtol, c.atol)) << "output " << describe(y_gpu.cpu(), y_cpu);
  EXPECT_TRUE(close(rstd_gpu, rstd_cpu, 1e-5, 1e-6))
      << "rstd " << describe(rstd_gpu.cpu(), rstd_cpu);

  const auto [dx_cpu, dw_cpu] = d9d::kernels::rms_norm_backward(dy, x, w, rstd_cpu);
  const auto [dx_gpu, dw_gpu] =
      d9d::kernels::rms_norm_backward(dy.cuda(), x.cuda(), w.cuda(), rstd_gpu);
  EXPECT_EQ(dx_gpu.scalar_type(), c.dtype);
  EXPECT_EQ(dw_gpu.scalar_type(), c.weight());
  const double rows = static_cast<double>(x.numel()) / static_cast<double>(c.shape.back());
  EXPECT_TRUE(close(dx_gpu, dx_cpu, c.rtol, c.atol))
      << "grad_input " << describe(dx_gpu.cpu(), dx_cpu);
  EXPECT_TRUE(close(dw_gpu, dw_cpu, c.rtol, c.atol * std::sqrt(rows)))
      << "grad_weight " << describe(dw_gpu.cpu(), dw_cpu);
}

TEST_P(Kernels_RmsNorm_Cuda, AutogradThroughTheOpOnCuda) {
  const auto& c = GetParam();
  at::manual_seed(1);
  const auto x = at::randn(c.shape, at::kDouble).to(c.dtype);
  const auto w = (1.0 + 0.1 * at::randn({c.shape.back()}, at::kDouble)).to(c.weight());
  auto xg = x.cuda().requires_grad_(true);
  auto wg = w.cuda().requires_grad_(true);
  auto xc = x.clone().requires_grad_(true);
  auto wc = w.clone().requires_grad_(true);
  const auto gpu =
      torch::autograd::grad({d9d::kernels::rms_norm(xg, wg, 1e-5, c.out_arg()).sum()}, {xg, wg});
  const auto cpu =
      torch::autograd::grad({d9d::kernels::rms_norm(xc, wc, 1e-5, c.out_arg()).sum()}, {xc, wc});
  const double rows = static_cast<double>(x.numel()) / static_cast<double>(c.shape.back());
  EXPECT_TRUE(close(gpu[0], cpu[0], c.rtol, c.atol)) << describe(gpu[0].cpu(), cpu[0]);
  EXPECT_TRUE(close(gpu[1], cpu[1], c.rtol, c.atol * std::sqrt(rows)))
      << describe(gpu[1].cpu(), cpu[1]);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Kernels_RmsNorm_Cuda,
    ::testing::Values(
        Case{at::kFloat, {4096, 4096}, 1e-5, 1e-5}, Case{at::kFloat, {3, 7, 1024}, 1e-5, 1e-5},
        Case{at::kFloat, {1000, 4097}, 1e-5, 1e-5},  // unaligned: scalar path
        Case{at::kFloat, {5, 1}, 1e-5, 1e-5}, Case{at::kDouble, {64, 2048}, 1e-10, 1e-10},
        Case{at::kBFloat16, {4096, 4096}, 1e-2, 1.6e-2},
        Case{at::kBFloat16, {65536, 128}, 1e-2, 1.6e-2},
        Case{at::kBFloat16, {2, 8192}, 1e-2, 1.6e-2},
        Case{at::kBFloat16, {1000, 1000}, 1e-2, 1.6e-2}, Case{at::kHalf, {512, 2048}, 2e-3, 2e-3},
        // Short rows sharing a warp (8, 2 and 2 threads per row), row counts that leave a block's
        // last groups empty.
        Case{at::kBFloat16, {777, 256}, 1e-2, 1.6e-2}, Case{at::kFloat, {1001, 24}, 1e-5, 1e-5},
        Case{at::kDouble, {333, 16}, 1e-10, 1e-10},
        // Mixed precision (a float32 weight with bfloat16 / half; float32 into bfloat16 / half),
        // on the vector path, the long-row path and the unaligned path.
        Case{at::kBFloat16, {16384, 128}, 1e-2, 1.6e-2, at::kFloat},
        Case{at::kBFloat16, {4096, 1024}, 1e-2, 1.6e-2, at::kFloat},
        Case{at::kBFloat16, {64, 12288}, 1e-2, 1.6e-2, at::kFloat},
        Case{at::kBFloat16, {300, 1000}, 1e-2, 1.6e-2, at::kFloat},
        Case{at::kHalf, {512, 2048}, 2e-3, 2e-3, at::kFloat},
        Case{at::kFloat, {4096, 1024}, 1e-2, 1.6e-2, at::kFloat, at::kBFloat16},
        Case{at::kFloat, {64, 12288}, 1e-2, 1.6e-2, at::kFloat, at::kBFloat16},
        Case{at::kFloat, {300, 1000}, 1e-2, 1.6e-2, at::kFloat, at::kBFloat16},
        Case{at::kFloat, {512, 2048}, 2e-3, 2e-3, at::kFloat, at::kHalf}),
    d9d::testing::RmsNormCaseName());

TEST(Kernels_RmsNorm_Cuda_Api, EmptyAndNonContiguousInputs) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const auto w = at::rand({64}, at::TensorOptions().device(at::kCUDA)) + 0.5;
  EXPECT_EQ(d9d::kernels::rms_norm(at::randn({0, 64}, w.options()), w, 1e-6).size(0), 0);
  const auto base = at::randn({64, 32}, w.options());
  const auto x = base.t();  // [32, 64], not contiguous
  EXPECT_TRUE(close(d9d::kernels::rms_norm(x, w, 1e-6),
                    d9d::kernels::rms_norm(x.cpu(), w.cpu(), 1e-6), 1e-5, 1e-5));
}

}  // namespace
