// d9d::scale_ on the CPU (the reference kernel): bfloat16 elements become the float32 product
// with the float32 scale rounded once to nearest even, element by element as the definition says
// (a float64 scale is taken to float32 first, and is not rounded to bfloat16's 8 bits); other
// dtypes are multiplied in their own dtype; non-contiguous and empty tensors are handled; bad
// arguments are refused with messages that name them.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/kernels/scale.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

// The definition, one element at a time: float32(x) * float32(scale), rounded to bfloat16.
at::Tensor expected_bf16(const at::Tensor& x, double scale) {
  const auto factor = static_cast<float>(scale);
  const auto in = x.contiguous();
  auto out = at::empty_like(in);
  const auto* src = in.const_data_ptr<c10::BFloat16>();
  auto* dst = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < in.numel(); ++i) {
    dst[i] = c10::BFloat16(static_cast<float>(src[i]) * factor);
  }
  return out;
}

bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  return at::equal(a.contiguous().view(at::kShort), b.contiguous().view(at::kShort));
}

TEST(Kernels_Scale_Cpu, Bf16IsTheFloat32ProductRoundedOnce) {
  at::manual_seed(3);
  const std::vector<int64_t> sizes = {5000, 0, 17, 4096 * 2 + 3};
  std::vector<at::Tensor> list;
  std::vector<at::Tensor> before;
  for (const auto n : sizes) {
    list.push_back((at::randn({n}) * 100).to(at::kBFloat16));
    before.push_back(list.back().clone());
  }
  // 0.3 is not a bfloat16 (nor a float32): a scale rounded to 8 bits would move most products.
  const double scale = 0.3;
  d9d::kernels::scale(list, at::scalar_tensor(scale, at::kDouble));
  int64_t moved_by_8_bit_scale = 0;
  for (size_t t = 0; t < list.size(); ++t) {
    EXPECT_TRUE(bits_equal(list[t], expected_bf16(before[t], scale))) << "tensor " << t;
    moved_by_8_bit_scale +=
        (list[t] != expected_bf16(before[t], static_cast<float>(c10::BFloat16(0.3F))))
            .sum()
            .item<int64_t>();
  }
  EXPECT_GT(moved_by_8_bit_scale, 1000);
}

TEST(Kernels_Scale_Cpu, OtherDtypesAreMultipliedInTheirOwn) {
  auto f32 = at::randn({1000});
  auto f64 = at::randn({1000}, at::kDouble);
  const auto f32_before = f32.clone();
  const auto f64_before = f64.clone();
  const double scale = 0.123456789012345;
  d9d::kernels::scale({f32}, at::scalar_tensor(scale, at::kDouble));
  d9d::kernels::scale({f64}, at::scalar_tensor(scale, at::kDouble));
  EXPECT_TRUE(at::equal(f32, f32_before * static_cast<float>(scale)));
  EXPECT_TRUE(at::equal(f64, f64_before * scale));
}

TEST(Kernels_Scale_Cpu, NonContiguousTensorsAndSpecialValues) {
  auto base = (at::randn({64, 48}) * 10).to(at::kBFloat16);
  auto transposed = base.t();  // a view: scaled in place through it
  auto special = at::tensor({std::numeric_limits<float>::infinity(), -0.0F,
                             std::numeric_limits<float>::quiet_NaN(), 3.0e38F})
                     .to(at::kBFloat16);
  const auto base_before = base.clone();
  d9d::kernels::scale({transposed, special}, at::scalar_tensor(2.5, at::kFloat));
  EXPECT_TRUE(bits_equal(base, expected_bf16(base_before, 2.5)));
  EXPECT_TRUE(std::isinf(special[0].item<float>()));
  EXPECT_TRUE(std::signbit(special[1].item<float>()));
  EXPECT_TRUE(std::isnan(special[2].item<float>()));
  EXPECT_TRUE(std::isinf(special[3].item<float>()));  // 7.5e38 overflows bfloat16 too
}

TEST(Kernels_Scale_Cpu, BadArgumentsAreRefusedByName) {
  const auto one = at::scalar_tensor(1.0);
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::kernels::scale({at::ones({2}), at::ones({2}, at::kDouble)}, one);
              }),
              HasSubstr("tensors[1] is Double, tensors[0] is Float (one dtype per list)"));
  EXPECT_THAT(d9d::testing::error_of([&] { d9d::kernels::scale({at::ones({2})}, at::ones({2})); }),
              HasSubstr("scale must be a 0-dim (or one-element) tensor"));
  EXPECT_THAT(d9d::testing::error_of([&] { d9d::kernels::scale({at::ones({2}, at::kInt)}, one); }),
              HasSubstr("tensors[0] is Int; it must be a floating type"));
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { d9d::kernels::scale({at::ones({2})}, at::scalar_tensor(2, at::kLong)); }),
              HasSubstr("scale is Long; it must be a floating type"));
}

}  // namespace
