// d9d::rope and d9d::silu_mul on CUDA (GPU machines only; ctest label "gpu"): the CUDA kernels
// against the CPU reference kernels on the same inputs, forward and backward, in every dtype, with
// aligned (vectorised) and unaligned (scalar) shapes.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/kernels/rope.hpp>
#include <d9d/kernels/silu_mul.hpp>

namespace {

struct Case {
  at::ScalarType dtype;
  double tol;  // one rounding of the output dtype, as a relative and absolute bound
};

std::vector<Case> cases() {
  return {{at::kDouble, 1e-12}, {at::kFloat, 1e-5}, {at::kBFloat16, 1.0 / 64}, {at::kHalf, 1e-2}};
}

bool close(const at::Tensor& got, const at::Tensor& want, double tol) {
  return at::allclose(got.cpu().to(at::kDouble), want.cpu().to(at::kDouble), tol, tol);
}

class Kernels_Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_F(Kernels_Cuda, RopeMatchesTheCpuReference) {
  for (const auto& c : cases()) {
    // head_dim 128 (vectorised) and 6 (half 3: the scalar path).
    for (const int64_t dim : {int64_t{128}, int64_t{6}}) {
      at::manual_seed(1);
      const auto table = c.dtype == at::kDouble ? at::kDouble : at::kFloat;
      const auto angles = at::rand({9, dim / 2}, at::kDouble) * 6.28;
      const auto cos = angles.cos().to(table);
      const auto sin = angles.sin().to(table);
      const auto x = at::randn({2, 9, 3, dim}, at::kDouble).to(c.dtype);
      const auto want = d9d::kernels::rope_forward(x, cos, sin, false);
      const auto got = d9d::kernels::rope_forward(x.cuda(), cos.cuda(), sin.cuda(), false);
      EXPECT_TRUE(close(got, want, c.tol)) << c.dtype << " dim " << dim;
      const auto inverse = d9d::kernels::rope_forward(x.cuda(), cos.cuda(), sin.cuda(), true);
      EXPECT_TRUE(close(inverse, d9d::kernels::rope_forward(x, cos, sin, true), c.tol))
          << c.dtype << " dim " << dim << " inverse";
    }
  }
}

TEST_F(Kernels_Cuda, SiluMulMatchesTheCpuReference) {
  for (const auto& c : cases()) {
    for (const int64_t n : {int64_t{12288}, int64_t{1001}}) {  // vectorised, and a tail
      at::manual_seed(2);
      const auto gate = (3 * at::randn({n}, at::kDouble)).to(c.dtype);
      const auto up = at::randn({n}, at::kDouble).to(c.dtype);
      const auto dh = at::randn({n}, at::kDouble).to(c.dtype);
      EXPECT_TRUE(close(d9d::kernels::silu_mul_forward(gate.cuda(), up.cuda()),
                        d9d::kernels::silu_mul_forward(gate, up), c.tol))
          << c.dtype << " n " << n;
      const auto [dg, du] = d9d::kernels::silu_mul_backward(dh.cuda(), gate.cuda(), up.cuda());
      const auto [dg_want, du_want] = d9d::kernels::silu_mul_backward(dh, gate, up);
      EXPECT_TRUE(close(dg, dg_want, 2 * c.tol)) << c.dtype << " n " << n << " grad gate";
      EXPECT_TRUE(close(du, du_want, c.tol)) << c.dtype << " n " << n << " grad up";
    }
  }
}

TEST_F(Kernels_Cuda, AutogradThroughTheOps) {
  const auto x = at::randn({2, 5, 4, 64}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat))
                     .requires_grad_(true);
  const auto angles = at::rand({5, 32}, at::TensorOptions().device(at::kCUDA)) * 6.28;
  const auto y = d9d::kernels::rope(x, angles.cos(), angles.sin());
  const auto dx = torch::autograd::grad({y}, {x}, {y.detach()})[0];
  // The rotation is orthogonal: the gradient of 1/2 |y|^2 is x.
  EXPECT_TRUE(at::allclose(dx, x.detach(), 1e-5, 1e-5));
}

}  // namespace
