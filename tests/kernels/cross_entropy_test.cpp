// d9d::cross_entropy_rows_ on the CPU (the reference kernel): the loss per row and the gradient
// left over the logits against ATen's cross_entropy and its autograd, in double (to rounding) and
// bfloat16 (one rounding of the gradient), ignored rows included; argument errors.
#include <string>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <d9d/kernels/cross_entropy.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

TEST(Kernels_CrossEntropyRows_Cpu, LossAndGradientEqualAtensInDouble) {
  at::manual_seed(8);
  const auto logits = at::randn({9, 37}, at::kDouble) * 3;
  auto labels = at::randint(0, 37, {9}, at::kLong);
  labels[2] = -100;
  labels[7] = -100;
  // Reference: per-row cross-entropy and d(sum of losses)/d(logits).
  const auto x = logits.clone().requires_grad_(true);
  const auto rows = at::cross_entropy_loss(x, labels, /*weight=*/{}, at::Reduction::None, -100);
  const auto grad = torch::autograd::grad({rows.sum()}, {x})[0];
  auto work = logits.clone();
  const auto loss = d9d::kernels::cross_entropy_rows_(work, labels, -100);
  EXPECT_EQ(loss.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::allclose(loss, rows, 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(work, grad, 1e-12, 1e-14));
  EXPECT_EQ(loss[2].item<double>(), 0.0);
  EXPECT_EQ(work[7].abs().sum().item<double>(), 0.0);
}

TEST(Kernels_CrossEntropyRows_Cpu, Bfloat16LogitsRoundTheGradientOnce) {
  at::manual_seed(9);
  const auto logits = (at::randn({5, 1000}) * 4).to(at::kBFloat16);
  const auto labels = at::randint(0, 1000, {5}, at::kLong);
  const auto exact = logits.to(at::kDouble).requires_grad_(true);
  const auto rows = at::cross_entropy_loss(exact, labels, /*weight=*/{}, at::Reduction::None, -100);
  const auto grad = torch::autograd::grad({rows.sum()}, {exact})[0];
  auto work = logits.clone();
  const auto loss = d9d::kernels::cross_entropy_rows_(work, labels, -100);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  // The loss in float from the bfloat16 logits; the gradient rounded once to bfloat16.
  EXPECT_TRUE(at::allclose(loss.to(at::kDouble), rows, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(work.to(at::kDouble), grad, 1.0 / 128, 1e-6));
}

TEST(Kernels_CrossEntropyRows_Cpu, ArgumentErrorsNameTheArgument) {
  auto logits = at::zeros({3, 4});
  EXPECT_THAT(d9d::testing::error_of<c10::Error>([&] {
                (void)d9d::kernels::cross_entropy_rows_(logits, at::zeros({2}, at::kLong), -100);
              }),
              HasSubstr("labels [3] expected"));
  EXPECT_THAT(d9d::testing::error_of<c10::Error>([&] {
                (void)d9d::kernels::cross_entropy_rows_(logits, at::zeros({3}, at::kInt), -100);
              }),
              HasSubstr("labels must be int64"));
  EXPECT_THAT(d9d::testing::error_of<c10::Error>([&] {
                (void)d9d::kernels::cross_entropy_rows_(logits, at::full({3}, 4, at::kLong), -100);
              }),
              HasSubstr("label 4 of row 0 is outside [0, 4)"));
  auto strided = at::zeros({4, 3}).t();
  EXPECT_THAT(d9d::testing::error_of<c10::Error>([&] {
                (void)d9d::kernels::cross_entropy_rows_(strided, at::zeros({3}, at::kLong), -100);
              }),
              HasSubstr("logits must be contiguous"));
}

}  // namespace
