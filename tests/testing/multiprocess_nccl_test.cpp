// The harness with NCCL (GPU machines only; ctest label "gpu"): a 2-rank all-reduce on CUDA
// tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/cuda.h>

#include <d9d/testing/multiprocess.hpp>

namespace {

using d9d::testing::Backend;
using d9d::testing::RankEnv;

TEST(Harness_Nccl_ws2, AllReduceSumsOnGpus) {
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, found " << torch::cuda::device_count();
  }
  d9d::testing::run_on_ranks({.world_size = 2, .backend = Backend::nccl}, [](RankEnv& env) {
    const auto device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.rank()));
    std::vector<at::Tensor> tensors = {at::full({1 << 20}, static_cast<float>(env.rank() + 1),
                                                at::TensorOptions().device(device))};
    env.process_group().allreduce(tensors)->wait();
    torch::cuda::synchronize(env.rank());
    EXPECT_TRUE(at::all(tensors[0].cpu() == 3.0F).item<bool>())
        << "rank " << env.rank() << " got " << tensors[0].slice(0, 0, 4).cpu();
  });
}

}  // namespace
