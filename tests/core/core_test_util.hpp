// Helpers shared by the core tests: a DistributedContext inside a rank of the test harness.
#pragma once

#include <arpa/inet.h>
#include <chrono>
#include <netinet/in.h>
#include <stdexcept>
#include <sys/socket.h>
#include <unistd.h>

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

/// A TCP port on 127.0.0.1 that was free a moment ago (as tools/d9drun picks MASTER_PORT).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): the sockets API
  auto* generic = reinterpret_cast<sockaddr*>(&address);
  if (fd < 0 || ::bind(fd, generic, sizeof(address)) != 0 ||
      ::getsockname(fd, generic, &length) != 0) {
    if (fd >= 0) {
      ::close(fd);
    }
    throw std::runtime_error("d9d::testing::free_port: no free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(address.sin_port);
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
