// Helpers shared by the core tests: a DistributedContext inside a rank of the test harness.
#pragma once

#include <chrono>

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <d9d/core/distributed_context.hpp>
#include <d9d/testing/multiprocess.hpp>

namespace d9d::testing {

/// The rank's context from the harness's torchrun variables; cpu/Gloo, or cuda/NCCL when the
/// harness runs with D9D_TEST_BACKEND=nccl.
inline DistributedContext rank_context(const RankEnv& env) {
  return DistributedContext::from_env({.init_timeout = std::chrono::seconds(60),
                                       .step_timeout = std::chrono::seconds(60),
                                       .device = env.backend() == Backend::nccl ? "cuda" : "cpu"});
}

/// True when this run cannot give `world` ranks one GPU each (NCCL runs on a small machine).
inline bool world_exceeds_gpus(int world) {
  return default_backend() == Backend::nccl &&
         world > static_cast<int>(torch::cuda::device_count());
}

}  // namespace d9d::testing

/// Skips the test (in the parent, before any rank starts) when NCCL needs more GPUs than visible.
#define D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(world)                                                  \
  do {                                                                                         \
    if (d9d::testing::world_exceeds_gpus(world)) {                                             \
      GTEST_SKIP() << "needs " << (world) << " GPUs for NCCL, " << torch::cuda::device_count() \
                   << " visible";                                                              \
    }                                                                                          \
  } while (false)
