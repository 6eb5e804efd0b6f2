// d9d::float8_quantize and d9d::kernels::float8_matmul on the CPU: the quantisation against its
// definition written again in double (tests/kernels/float8_reference.hpp) for every grouping,
// layout, format and input dtype, bit for bit, with a factor per column too; a NaN or infinite
// value poisons only its group; float8 bytes transpose as bytes;
// float8 inputs are rescaled exactly; the product equals the exact product of the dequantised
// operands to float32 rounding; argument errors say what is wrong. The sharded per-tensor path
// (d9d/kernels/float8_sharded.hpp): shards' maxima as bits, reduced by an integer maximum, give
// each shard the rows of the whole tensor's quantisation.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/kernels/float8.hpp>
#include <d9d/kernels/float8_sharded.hpp>

#include "tests/kernels/float8_reference.hpp"
#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

// Rows of very different magnitudes (so per-row scales differ), a zero row, values deep in the
// subnormal range of e4m3 next to large ones (within a tensor-wide group), negative values.
at::Tensor awkward(int64_t rows, int64_t cols, at::ScalarType type, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  auto x = at::randn({rows, cols}, generator, at::kDouble);
  const auto magnitudes = at::pow(10.0, at::linspace(-4, 3, rows, at::kDouble)).unsqueeze(1);
  x = x * magnitudes;
  x[1].zero_();
  x[rows - 1][0] = 1e-7;  // tiny beside the row's others
  return x.to(type);
}

// The kernel's output equals the definition: bytes where the reference is finite, NaN where not.
void expect_matches_reference(const d9d::kernels::Float8Tensor& got,
                              const d9d::testing::Float8Reference& want, const std::string& what) {
  ASSERT_EQ(got.data.sizes(), want.values.sizes()) << what;
  ASSERT_EQ(got.scale.sizes(), want.scale.sizes()) << what;
  const auto values = got.data.to(at::kDouble);
  const auto finite = at::isfinite(want.values);
  EXPECT_TRUE(at::equal(at::isnan(values), at::logical_not(finite))) << what;
  EXPECT_TRUE(at::equal(values.masked_fill(finite.logical_not(), 0),
                        want.values.masked_fill(finite.logical_not(), 0)))
      << what << ": max diff "
      << (values - want.values).masked_fill(finite.logical_not(), 0).abs().max().item<double>();
  const auto scale = got.scale.to(at::kDouble);
  const auto scale_finite = at::isfinite(want.scale);
  EXPECT_TRUE(at::equal(scale.masked_fill(scale_finite.logical_not(), 0),
                        want.scale.masked_fill(scale_finite.logical_not(), 0)))
      << what;
  EXPECT_TRUE(at::isnan(scale).equal(scale_finite.logical_not())) << what;
}

std::string name_of(at::ScalarType format, bool rowwise, bool transpose, at::ScalarType input) {
  return std::string(c10::toString(format)) + (rowwise ? " rowwise" : " tensorwise") +
         (transpose ? " transposed" : "") + " from " + c10::toString(input);
}

TEST(Kernels_Float8_Cpu, QuantizationEqualsTheDefinitionBitForBit) {
  for (const auto input : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const auto x = awkward(9, 40, input, 11);
    for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      for (const bool rowwise : {true, false}) {
        for (const bool transpose : {false, true}) {
          expect_matches_reference(d9d::kernels::float8_quantize(x, format, rowwise, transpose),
                                   d9d::testing::float8_reference(x, format, rowwise, transpose),
                                   name_of(format, rowwise, transpose, input));
        }
      }
    }
  }
}

TEST(Kernels_Float8_Cpu, BothFormsInOneCallEqualTheSeparateCalls) {
  const auto x = awkward(7, 24, at::kBFloat16, 16);
  for (const bool rowwise : {true, false}) {
    const auto [rows, columns] = d9d::kernels::float8_quantize_both(x, at::kFloat8_e5m2, rowwise);
    const auto want_rows = d9d::kernels::float8_quantize(x, at::kFloat8_e5m2, rowwise);
    const auto want_columns = d9d::kernels::float8_quantize(x, at::kFloat8_e5m2, rowwise, true);
    EXPECT_TRUE(at::equal(rows.data.view(at::kByte), want_rows.data.view(at::kByte)));
    EXPECT_TRUE(at::equal(rows.scale, want_rows.scale));
    EXPECT_TRUE(at::equal(columns.data.view(at::kByte), want_columns.data.view(at::kByte)));
    EXPECT_TRUE(at::equal(columns.scale, want_columns.scale));
  }
}

TEST(Kernels_Float8_Cpu, FactorPerColumnMultipliesTheRowsBeforeTheirQuantisation) {
  // What the float8 layer's backward does to its gradient: the weight's row scales (powers of
  // two) folded into the gradient's columns.
  auto generator = at::detail::createCPUGenerator(17);
  const auto factor = at::pow(2.0, at::randint(-8, 9, {1, 24}, generator)).to(at::kFloat);
  for (const auto input : {at::kFloat, at::kBFloat16}) {
    const auto x = awkward(7, 24, input, 18);
    for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      const auto rows = d9d::kernels::float8_quantize(x, format, true, false, factor);
      expect_matches_reference(rows, d9d::testing::float8_reference(x, format, true, false, factor),
                               name_of(format, true, false, input) + " times a factor");
      // The factor changes the rows' groups: not the plain quantisation.
      EXPECT_FALSE(at::equal(rows.scale, d9d::kernels::float8_quantize(x, format, true).scale));
      const auto [both_rows, both_columns] =
          d9d::kernels::float8_quantize_both(x, format, true, factor);
      EXPECT_TRUE(at::equal(both_rows.data.view(at::kByte), rows.data.view(at::kByte)));
      EXPECT_TRUE(at::equal(both_rows.scale, rows.scale));
      // The columns are x's own.
      const auto columns = d9d::kernels::float8_quantize(x, format, true, true);
      EXPECT_TRUE(at::equal(both_columns.data.view(at::kByte), columns.data.view(at::kByte)));
      EXPECT_TRUE(at::equal(both_columns.scale, columns.scale));
    }
  }
}

TEST(Kernels_Float8_Cpu, TransposeMovesTheBytes) {
  const auto x = awkward(9, 40, at::kFloat, 19);
  const auto whole = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, false);
  const auto t = d9d::kernels::float8_transpose(whole, /*unit_scales=*/false);
  EXPECT_TRUE(t.data.is_contiguous());
  EXPECT_TRUE(at::equal(t.data.view(at::kByte), whole.data.view(at::kByte).t()));
  EXPECT_TRUE(at::equal(t.scale, whole.scale));
  const auto rows = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true);
  const auto unit = d9d::kernels::float8_transpose(rows, /*unit_scales=*/true);
  EXPECT_TRUE(at::equal(unit.data.view(at::kByte), rows.data.view(at::kByte).t()));
  EXPECT_TRUE(at::equal(unit.scale, at::ones({40, 1})));
}

TEST(Kernels_Float8_Cpu, ScalesArePowersOfTwoThatFitTheLargestValue) {
  const auto x = awkward(6, 33, at::kFloat, 12);
  const auto q = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true);
  const auto inverse = q.scale.to(at::kDouble).view({-1});
  for (int64_t r = 0; r < x.size(0); ++r) {
    const double s = 1.0 / inverse[r].item<double>();
    EXPECT_EQ(std::exp2(std::round(std::log2(s))), s) << "row " << r;
    const double amax = x[r].abs().max().item<double>();
    if (amax > 0) {
      // The largest value lands in (M/2, M]: the whole range above the top binade is used.
      EXPECT_LE(amax * s, 448.0) << "row " << r;
      EXPECT_GT(amax * s, 224.0) << "row " << r;
    }
  }
  // A zero row: scale 2^floor(log2(448 / 1e-12)), values zero.
  EXPECT_TRUE(at::equal(q.data[1].to(at::kFloat), at::zeros({33})));
  EXPECT_EQ(1.0 / inverse[1].item<double>(), std::exp2(std::floor(std::log2(448.0F / 1e-12F))));
}

// Three shards of rows (one empty) of tensors whose largest values sit in the last shard: each
// shard quantised with the maximum of all shards' bits equals those rows of the whole tensor's
// per-tensor quantisation; with its own maximum alone it would not. A NaN or an infinity in one
// shard makes every shard NaN.
TEST(Kernels_Float8_Cpu, ShardsQuantisedWithTheWholeMaximumEqualTheWholeQuantisation) {
  for (const auto input : {at::kFloat, at::kDouble, at::kBFloat16}) {
    const auto whole = awkward(12, 40, input, 21);  // rows grow in magnitude: the last is largest
    for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      const auto want = d9d::kernels::float8_quantize(whole, format, false);
      const std::vector<std::pair<int64_t, int64_t>> shards = {{0, 5}, {5, 0}, {5, 7}};
      auto bits = at::zeros({}, at::kInt);
      for (const auto& [start, length] : shards) {
        bits = at::maximum(bits, d9d::kernels::float8_amax_bits(whole.narrow(0, start, length)));
      }
      EXPECT_EQ(bits.item<int32_t>(), d9d::kernels::float8_amax_bits(whole).item<int32_t>());
      for (const auto& [start, length] : shards) {
        const auto part = whole.narrow(0, start, length);
        const auto got = d9d::kernels::float8_quantize_with_amax(part, bits, format);
        const std::string what = name_of(format, false, false, input) + " rows " +
                                 std::to_string(start) + "+" + std::to_string(length);
        EXPECT_TRUE(
            at::equal(got.data.view(at::kByte), want.data.narrow(0, start, length).view(at::kByte)))
            << what;
        EXPECT_TRUE(at::equal(got.scale, want.scale)) << what;
        if (length > 0 && start == 0) {  // the small rows alone take another scale
          EXPECT_FALSE(
              at::equal(d9d::kernels::float8_quantize(part, format, false).scale, want.scale))
              << what;
        }
      }
    }
  }
  auto poisoned = at::randn({6, 16});
  poisoned[4][2] = std::numeric_limits<float>::quiet_NaN();
  for (const bool infinite : {false, true}) {
    if (infinite) {
      poisoned[4][2] = std::numeric_limits<float>::infinity();
    }
    const auto bits = at::maximum(d9d::kernels::float8_amax_bits(poisoned.narrow(0, 0, 3)),
                                  d9d::kernels::float8_amax_bits(poisoned.narrow(0, 3, 3)));
    const auto clean =
        d9d::kernels::float8_quantize_with_amax(poisoned.narrow(0, 0, 3), bits, at::kFloat8_e4m3fn);
    EXPECT_TRUE(at::isnan(d9d::kernels::float8_dequantize(clean)).all().item<bool>())
        << (infinite ? "infinity" : "NaN");
  }
  EXPECT_THAT(d9d::testing::error_of([] {
                (void)d9d::kernels::float8_quantize_with_amax(at::ones({2, 16}), at::ones({}),
                                                              at::kFloat8_e4m3fn);
              }),
              HasSubstr("amax_bits is one int32"));
}

// FullyShard takes a step's maxima from the float32 shards and rounds them to the compute dtype
// (fully_shard.cpp, take_step_maxima): rounding is monotonic, so that equals the maximum of the
// rounded values, which the gather then quantises. NaN and infinity survive the rounding.
TEST(Kernels_Float8_Cpu, MaximumRoundedToBfloat16IsTheMaximumOfTheRoundedValues) {
  const auto rounded = [](const at::Tensor& bits) {
    return bits.view(at::kFloat).to(at::kBFloat16).to(at::kFloat).view(at::kInt).item<int32_t>();
  };
  for (const int64_t seed : {1, 2, 3}) {
    // Values whose float32 maximum is not a bfloat16 (most are not), some rounding up.
    const auto x = awkward(9, 33, at::kFloat, seed) * (1.0 + 1.0 / 300.0);
    const auto from_rounded = d9d::kernels::float8_amax_bits(x.to(at::kBFloat16));
    EXPECT_EQ(rounded(d9d::kernels::float8_amax_bits(x)), from_rounded.item<int32_t>()) << seed;
    EXPECT_NE(d9d::kernels::float8_amax_bits(x).item<int32_t>(), from_rounded.item<int32_t>())
        << "the float32 maximum happens to be a bfloat16: the case shows nothing, seed " << seed;
  }
  for (const float special :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto x = at::randn({3, 16});
    x[1][5] = special;
    EXPECT_EQ(rounded(d9d::kernels::float8_amax_bits(x)),
              d9d::kernels::float8_amax_bits(x.to(at::kBFloat16)).item<int32_t>())
        << special;
  }
}

TEST(Kernels_Float8_Cpu, NanOrInfinityMakesOnlyItsGroupNan) {
  auto x = at::randn({4, 16});
  x[1][3] = std::numeric_limits<float>::quiet_NaN();
  x[2][5] = std::numeric_limits<float>::infinity();
  const auto rows = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true);
  const auto values = d9d::kernels::float8_dequantize(rows);
  for (int64_t r = 0; r < 4; ++r) {
    const bool poisoned = r == 1 || r == 2;
    EXPECT_EQ(at::isnan(values[r]).all().item<bool>(), poisoned) << "row " << r;
    EXPECT_EQ(at::isfinite(values[r]).all().item<bool>(), !poisoned) << "row " << r;
  }
  const auto whole = d9d::kernels::float8_quantize(x, at::kFloat8_e5m2, false, true);
  EXPECT_TRUE(at::isnan(d9d::kernels::float8_dequantize(whole)).all().item<bool>());
}

TEST(Kernels_Float8_Cpu, Float8InputIsRescaledExactly) {
  // Per-row float8 rows requantised per column (what backward does to the forward's weight) equal
  // the quantisation of their exact dequantised values.
  const auto w = awkward(12, 48, at::kBFloat16, 13);
  const auto rows = d9d::kernels::float8_quantize(w, at::kFloat8_e4m3fn, true);
  const auto exact = d9d::kernels::float8_dequantize(rows);  // exact in float32
  for (const bool rowwise : {true, false}) {
    const auto columns = d9d::kernels::float8_quantize(rows.data, at::kFloat8_e4m3fn, rowwise,
                                                       /*transpose=*/true, rows.scale);
    expect_matches_reference(columns,
                             d9d::testing::float8_reference(exact, at::kFloat8_e4m3fn, rowwise,
                                                            /*transpose=*/true),
                             rowwise ? "per-column requantisation" : "per-tensor requantisation");
  }
  // A per-tensor float8 tensor requantised per tensor keeps its values (transposed).
  const auto whole = d9d::kernels::float8_quantize(w, at::kFloat8_e4m3fn, false);
  const auto again =
      d9d::kernels::float8_quantize(whole.data, at::kFloat8_e4m3fn, false, true, whole.scale);
  EXPECT_TRUE(at::equal(d9d::kernels::float8_dequantize(again),
                        d9d::kernels::float8_dequantize(whole).t()));
}

TEST(Kernels_Float8_Cpu, ProductEqualsTheDequantisedOperandsProduct) {
  const auto a = awkward(10, 32, at::kFloat, 14);
  const auto b = awkward(24, 32, at::kFloat, 15).flip(0);
  for (const bool rowwise : {true, false}) {
    const auto qa = d9d::kernels::float8_quantize(a, at::kFloat8_e4m3fn, rowwise);
    const auto qb = d9d::kernels::float8_quantize(b, at::kFloat8_e4m3fn, rowwise);
    const auto exact = at::mm(d9d::kernels::float8_dequantize(qa, at::kDouble),
                              d9d::kernels::float8_dequantize(qb, at::kDouble).t());
    const auto got = d9d::kernels::float8_matmul(qa, qb, at::kFloat);
    ASSERT_EQ(got.scalar_type(), at::kFloat);
    // float32 accumulation of 32 products, against the row's magnitude.
    const auto bound = 64 * 6e-8 *
                       at::mm(d9d::kernels::float8_dequantize(qa, at::kDouble).abs(),
                              d9d::kernels::float8_dequantize(qb, at::kDouble).abs().t());
    EXPECT_TRUE(((got.to(at::kDouble) - exact).abs() <= bound).all().item<bool>())
        << (rowwise ? "rowwise" : "tensorwise");
    EXPECT_GT(exact.abs().max().item<double>(), 0.0);
  }
}

TEST(Kernels_Float8_Cpu, ArgumentErrorsSayWhatIsWrong) {
  using d9d::testing::error_of;
  const auto x = at::randn({4, 16});
  EXPECT_THAT(
      error_of([&] { (void)d9d::kernels::float8_quantize(x[0], at::kFloat8_e4m3fn, true); }),
      HasSubstr("x must be 2-D"));
  EXPECT_THAT(error_of([&] { (void)d9d::kernels::float8_quantize(x, at::kBFloat16, true); }),
              HasSubstr("Float8_e4m3fn or Float8_e5m2"));
  const auto q = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true);
  EXPECT_THAT(
      error_of([&] { (void)d9d::kernels::float8_quantize(q.data, at::kFloat8_e4m3fn, true); }),
      HasSubstr("needs its scale"));
  EXPECT_THAT(error_of([&] {
                (void)d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true, false, q.scale);
              }),
              HasSubstr("a factor per column [1, cols]"));
  const auto factor = at::ones({1, 16});
  EXPECT_THAT(error_of([&] {
                (void)d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, true, true, factor);
              }),
              HasSubstr("takes per-row scales, not transposed"));
  EXPECT_THAT(error_of([&] {
                (void)d9d::kernels::float8_quantize_both(x, at::kFloat8_e4m3fn, false, factor);
              }),
              HasSubstr("takes per-row scales"));
  EXPECT_THAT(error_of([&] { (void)d9d::kernels::float8_transpose(q, /*unit_scales=*/false); }),
              HasSubstr("unit scales only"));
  const auto p = d9d::kernels::float8_quantize(x, at::kFloat8_e4m3fn, false);
  EXPECT_THAT(error_of([&] { (void)d9d::kernels::float8_matmul(q, p, at::kFloat); }),
              HasSubstr("per row, or both per tensor"));
}

}  // namespace
