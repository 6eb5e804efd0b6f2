// d9d::scale_ on CUDA (GPU machines only; ctest label "gpu"): the one-launch bfloat16 kernel is
// bit-identical to the CPU reference kernel on the same inputs (a NaN stays a NaN, its payload
// aside), for aligned (16-byte, vectorised) and unaligned (scalar) lists, sizes across the
// 4096-element blocks with tails, an empty tensor in the middle, a non-contiguous view, special
// values, float32 lists, a scale on the device that the host never reads, and under CUDA graph
// capture.
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/kernels/scale.hpp>

#include "tests/kernels/cuda_views.hpp"

namespace {

// Equal bits, except that a NaN only has to meet a NaN: its payload is not part of the
// definition (the first run compared raw bits and failed on the NaN elements alone).
::testing::AssertionResult bits_equal(const at::Tensor& a, const at::Tensor& b) {
  const auto x = a.cpu().contiguous().reshape(-1);
  const auto y = b.cpu().contiguous().reshape(-1);
  const auto differ = x.view(at::kShort).ne(y.view(at::kShort)) & ~(x.isnan() & y.isnan());
  if (!differ.any().item<bool>()) {
    return ::testing::AssertionSuccess();
  }
  const auto i = differ.nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure()
         << differ.sum().item<int64_t>() << " elements differ, the first at " << i << ": "
         << x[i].item<float>() << " (0x" << std::hex << (x.view(at::kShort)[i].item<int>() & 0xFFFF)
         << ") against " << y[i].item<float>() << " (0x"
         << (y.view(at::kShort)[i].item<int>() & 0xFFFF) << ")";
}

class Kernels_Scale_Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_F(Kernels_Scale_Cuda, Bf16ListIsBitIdenticalToTheCpuKernel) {
  for (const int64_t skip : {0, 1}) {
    at::manual_seed(5);
    const std::vector<int64_t> sizes = {4096 * 3 + 5, 1, 0, 7, 4096, 300001, 4095};
    std::vector<at::Tensor> cpu;
    for (const auto n : sizes) {
      auto t = (at::randn({n}) * 50).to(at::kBFloat16);
      if (n >= 4) {  // special values, some in the vectorised body
        t[0] = std::numeric_limits<float>::infinity();
        t[1] = std::numeric_limits<float>::quiet_NaN();
        t[2] = -0.0F;
        t[3] = 3.0e38F;
      }
      cpu.push_back(t);
    }
    // skip 1: each data pointer 2 bytes past a 16-byte boundary.
    auto gpu = d9d::testing::to_cuda_views(cpu, skip);
    const auto scale = at::scalar_tensor(0.3, at::kDouble);
    d9d::kernels::scale(cpu, scale);
    d9d::kernels::scale(gpu, scale.cuda());
    for (size_t t = 0; t < cpu.size(); ++t) {
      EXPECT_TRUE(bits_equal(cpu[t], gpu[t])) << "skip " << skip << ", tensor " << t;
    }
  }
}

TEST_F(Kernels_Scale_Cuda, NonContiguousAndFloat32ListsMatchTheCpuKernel) {
  at::manual_seed(6);
  auto cpu_matrix = (at::randn({96, 33}) * 10).to(at::kBFloat16);
  auto gpu_matrix = cpu_matrix.cuda();
  auto cpu_f32 = at::randn({5001});
  auto gpu_f32 = cpu_f32.cuda();
  auto cpu_contiguous = (at::randn({9000})).to(at::kBFloat16);
  auto gpu_contiguous = cpu_contiguous.cuda();
  const auto scale = at::scalar_tensor(1.7, at::kFloat);
  d9d::kernels::scale({cpu_matrix.t(), cpu_contiguous}, scale);
  d9d::kernels::scale({gpu_matrix.t(), gpu_contiguous}, scale.cuda());
  d9d::kernels::scale({cpu_f32}, scale);
  d9d::kernels::scale({gpu_f32}, scale.cuda());
  EXPECT_TRUE(bits_equal(cpu_matrix, gpu_matrix));
  EXPECT_TRUE(bits_equal(cpu_contiguous, gpu_contiguous));
  EXPECT_TRUE(at::allclose(cpu_f32, gpu_f32.cpu(), 0, 0));
}

TEST_F(Kernels_Scale_Cuda, ScaleComputedOnTheDeviceAndUnderGraphCapture) {
  at::manual_seed(7);
  auto cpu = (at::randn({20000}) * 3).to(at::kBFloat16);
  auto eager = cpu.cuda();
  auto graphed = cpu.cuda();
  // A scale that exists only on the device, as the clipping computes it.
  const auto norm = at::randn({100}, at::TensorOptions().device(at::kCUDA)).norm();
  const auto device_scale = 1.0 / (norm + 1e-6);
  d9d::kernels::scale({cpu}, device_scale.cpu());
  d9d::kernels::scale({eager}, device_scale);
  EXPECT_TRUE(bits_equal(cpu, eager));

  const auto stream = c10::cuda::getStreamFromPool();
  {
    const c10::cuda::CUDAStreamGuard guard(stream);
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    d9d::kernels::scale({graphed}, device_scale);
    graph.capture_end();
    graph.replay();
  }
  stream.synchronize();
  EXPECT_TRUE(bits_equal(cpu, graphed));
}

}  // namespace
