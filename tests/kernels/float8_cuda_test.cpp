// d9d::float8_quantize and the float8 GEMMs on CUDA (GPU machines only; ctest label "gpu"): the
// CUDA kernels bit for bit against the CPU reference kernel for every grouping, layout, format and
// input dtype, at shapes with tails; the at::_scaled_mm product against the emulation (the same
// quantised operands: only the accumulation order differs); float8 bytes transposed on the GPU
// (the tiled kernel and the strided copy); the float8 linear layer on the GPU
// against its CPU emulation, and against bfloat16 within float8's tolerance.
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <d9d/kernels/float8.hpp>
#include <d9d/kernels/float8_sharded.hpp>
#include <d9d/model/layers.hpp>

namespace {

class Kernels_Float8_Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

at::Tensor awkward(int64_t rows, int64_t cols, at::ScalarType type) {
  auto x = at::randn({rows, cols}, at::kDouble) *
           at::pow(10.0, at::linspace(-4, 3, rows, at::kDouble)).unsqueeze(1);
  x[1].zero_();
  x[rows - 1][0] = std::numeric_limits<double>::quiet_NaN();
  return x.to(type);
}

// Bytes equal, but NaNs (whose bit patterns the two conversions may spell differently).
void expect_same(const d9d::kernels::Float8Tensor& gpu, const d9d::kernels::Float8Tensor& cpu,
                 const std::string& what) {
  const auto g = gpu.data.cpu().to(at::kFloat);
  const auto c = cpu.data.to(at::kFloat);
  ASSERT_EQ(g.sizes(), c.sizes()) << what;
  EXPECT_TRUE(at::equal(at::isnan(g), at::isnan(c))) << what;
  EXPECT_TRUE(at::equal(g.nan_to_num(0), c.nan_to_num(0))) << what;
  EXPECT_TRUE(at::equal(gpu.scale.cpu().nan_to_num(0), cpu.scale.nan_to_num(0))) << what;
}

TEST_F(Kernels_Float8_Cuda, QuantizationIsBitIdenticalToTheCpuKernel) {
  at::manual_seed(31);
  // 77 columns: the general kernels; 96 and 128: the fast ones (whole 16-byte vectors), with rows
  // that are not multiples of their tiles (301: nor of 4, the transposed stores' word) and a tile
  // multiple (256 x 128).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {301, 77}, {301, 96}, {300, 96}, {256, 128}};
  for (const auto& [rows, cols] : shapes) {
    for (const auto input : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
      const auto x = awkward(rows, cols, input);
      for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
        for (const bool rowwise : {true, false}) {
          const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                   c10::toString(input) + " -> " + c10::toString(format) +
                                   (rowwise ? " rowwise" : " tensorwise");
          for (const bool transpose : {false, true}) {
            expect_same(d9d::kernels::float8_quantize(x.cuda(), format, rowwise, transpose),
                        d9d::kernels::float8_quantize(x, format, rowwise, transpose),
                        what + (transpose ? " transposed" : ""));
          }
          const auto [gpu_rows, gpu_columns] =
              d9d::kernels::float8_quantize_both(x.cuda(), format, rowwise);
          const auto [cpu_rows, cpu_columns] =
              d9d::kernels::float8_quantize_both(x, format, rowwise);
          expect_same(gpu_rows, cpu_rows, what + " both: rows");
          expect_same(gpu_columns, cpu_columns, what + " both: columns");
          if (rowwise && input != at::kDouble) {
            // The rows times a power-of-two factor per column (the backward's gradient times the
            // weight's row scales).
            const auto factor = at::pow(2.0, at::randint(-6, 7, {1, cols})).to(at::kFloat);
            expect_same(d9d::kernels::float8_quantize(x.cuda(), format, true, false, factor.cuda()),
                        d9d::kernels::float8_quantize(x, format, true, false, factor),
                        what + " factor");
            const auto [gpu_f_rows, gpu_f_columns] =
                d9d::kernels::float8_quantize_both(x.cuda(), format, true, factor.cuda());
            const auto [cpu_f_rows, cpu_f_columns] =
                d9d::kernels::float8_quantize_both(x, format, true, factor);
            expect_same(gpu_f_rows, cpu_f_rows, what + " both with a factor: rows");
            expect_same(gpu_f_columns, cpu_f_columns, what + " both with a factor: columns");
          }
        }
      }
    }
  }
  // A float8 input with its per-row scale, requantised per column (the backward's weight).
  const auto w = awkward(96, 64, at::kBFloat16).nan_to_num(0);
  const auto rows = d9d::kernels::float8_quantize(w, at::kFloat8_e4m3fn, true);
  for (const bool rowwise : {true, false}) {
    expect_same(
        d9d::kernels::float8_quantize(rows.data.cuda(), at::kFloat8_e4m3fn, rowwise, true,
                                      rows.scale.cuda()),
        d9d::kernels::float8_quantize(rows.data, at::kFloat8_e4m3fn, rowwise, true, rows.scale),
        "requantised");
  }
  // The sharded per-tensor path: a shard's maximum as bits, and its rows cast with a given
  // maximum (the general and the fast kernels, an empty shard's scale), as the CPU kernels.
  for (const auto& [rows, cols] : shapes) {
    for (const auto input : {at::kFloat, at::kBFloat16, at::kDouble}) {
      const auto x = awkward(rows, cols, input).nan_to_num(0);
      const auto bits = d9d::kernels::float8_amax_bits(x.cuda());
      EXPECT_EQ(bits.cpu().item<int32_t>(), d9d::kernels::float8_amax_bits(x).item<int32_t>());
      const auto larger = bits + (1 << 23);  // twice the maximum: another scale
      for (const auto& given : {bits, larger}) {
        for (const int64_t length : {rows, int64_t{0}}) {
          expect_same(d9d::kernels::float8_quantize_with_amax(x.narrow(0, 0, length).cuda(), given,
                                                              at::kFloat8_e4m3fn),
                      d9d::kernels::float8_quantize_with_amax(x.narrow(0, 0, length), given.cpu(),
                                                              at::kFloat8_e4m3fn),
                      std::to_string(rows) + "x" + std::to_string(cols) + " " +
                          c10::toString(input) + " with a given maximum, " +
                          std::to_string(length) + " rows");
        }
      }
    }
  }
  // Float8 bytes transposed: the tiled kernel (whole 16-byte rows, rows a multiple of 4) and the
  // strided copy (the rest), byte for byte.
  for (const auto& [r, c] : std::vector<std::pair<int64_t, int64_t>>{
           {96, 64}, {300, 128}, {301, 96}, {64, 77}, {1000, 4096}}) {
    const auto q = d9d::kernels::float8_quantize(at::randn({r, c}), at::kFloat8_e4m3fn, false);
    const auto gpu = d9d::kernels::float8_transpose(
        {.data = q.data.cuda(), .scale = q.scale.cuda()}, /*unit_scales=*/false);
    EXPECT_TRUE(at::equal(gpu.data.cpu().view(at::kByte), q.data.view(at::kByte).t()))
        << r << "x" << c << " transposed";
  }
}

TEST_F(Kernels_Float8_Cuda, ScaledMmEqualsTheEmulationOnTheSameOperands) {
  at::manual_seed(32);
  for (const bool rowwise : {true, false}) {
    const auto a = at::randn({256, 512}, at::kBFloat16).cuda();
    const auto b = at::randn({384, 512}, at::kBFloat16).cuda();
    const auto qa = d9d::kernels::float8_quantize(a, at::kFloat8_e4m3fn, rowwise);
    const auto qb = d9d::kernels::float8_quantize(b, at::kFloat8_e4m3fn, rowwise);
    const auto tensor_cores = d9d::kernels::float8_matmul(qa, qb, at::kBFloat16).to(at::kFloat);
    const auto exact = at::mm(d9d::kernels::float8_dequantize(qa, at::kDouble).cpu(),
                              d9d::kernels::float8_dequantize(qb, at::kDouble).cpu().t());
    // float32 accumulation then one bfloat16 rounding: within 2^-8 relative of the exact product
    // (plus the accumulation's share).
    const auto error = (tensor_cores.cpu().to(at::kDouble) - exact).abs();
    const auto bound = exact.abs() * (1.0 / 256) + 1e-3 * exact.abs().max();
    EXPECT_TRUE((error <= bound).all().item<bool>())
        << (rowwise ? "rowwise" : "tensorwise") << ": max error " << error.max().item<double>();
  }
}

TEST_F(Kernels_Float8_Cuda, LinearOnTheGpuMatchesItsCpuEmulationAndBf16) {
  at::manual_seed(33);
  for (const bool rowwise : {true, false}) {
    d9d::model::Linear cpu(1024, 768);
    d9d::model::Linear gpu(1024, 768);
    {
      const at::NoGradGuard no_grad;
      gpu->weight.copy_(cpu->weight);
    }
    gpu->to(at::kCUDA);
    cpu->float8 =
        d9d::model::Float8Linear{.rowwise = rowwise, .weight = {}, .weight_transposed = {}};
    gpu->float8 = cpu->float8;
    const auto x = at::randn({4, 512, 1024}, at::kBFloat16);
    const auto g = at::randn({4, 512, 768}, at::kBFloat16);
    const auto xc = x.clone().requires_grad_(true);
    const auto xg = x.cuda().requires_grad_(true);
    const auto yc = cpu(xc);
    const auto yg = gpu(xg);
    torch::autograd::backward({yc}, {g});
    torch::autograd::backward({yg}, {g.cuda()});
    // Same quantised operands, different accumulation (and bfloat16 output on both): close.
    const auto relative = [](const at::Tensor& got, const at::Tensor& want) {
      const auto w = want.cpu().to(at::kFloat);
      return ((got.cpu().to(at::kFloat) - w).norm() / w.norm()).item<double>();
    };
    const std::string what = rowwise ? "rowwise" : "tensorwise";
    EXPECT_LT(relative(yg, yc), 1e-2) << what << " forward";
    EXPECT_LT(relative(xg.grad(), xc.grad()), 1e-2) << what << " input gradient";
    EXPECT_LT(relative(gpu->weight.grad(), cpu->weight.grad()), 1e-2) << what << " weight gradient";
    // Against the bfloat16 product: float8's few percent.
    const auto bf16 = at::linear(x.cuda(), gpu->weight.to(at::kBFloat16));
    EXPECT_LT(relative(yg, bf16), 0.08) << what;
    EXPECT_GT(relative(yg, bf16), 1e-3) << what;
  }
}

}  // namespace
