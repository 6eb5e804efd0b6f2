// A dying rank never hangs the job (d9d/core/distributed_context.hpp, the watchdog): on 4 Gloo
// ranks, rank 2 is killed (SIGKILL) in the middle of a training step, of a collective or of a
// distributed save, or throws in the middle of a step. Every other rank must end on its own (the
// harness would only kill it long after the bound), non-zero, with a line naming rank 2, and within
// the failure timeout + 10 s of rank 2's failure. Under NCCL (D9D_TEST_BACKEND=nccl, 2 GPUs;
// skipped otherwise) the same on 2 ranks, one GPU each: rank 1 killed mid-step and mid-collective,
// where the survivor waits on a GPU collective that can never finish.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/cuda.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/distributed.hpp>
#include <d9d/testing/multiprocess.hpp>
#include <d9d/train/trainer.hpp>

#include "tests/train/train_test_util.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using d9d::testing::RankEnv;
using ::testing::HasSubstr;

// The failure timeout of these runs: short, so that the tests are quick, yet ten heartbeat
// intervals (1 s each), so that a loaded 2-core machine never misses one for that long.
constexpr auto kFailureTimeout = std::chrono::seconds(10);
// The bound of the issue: the others have exited within the failure timeout + 10 s of the failure.
// What it takes (distributed_context.hpp): the timeout until the dead rank is found, up to two
// intervals for the verdict, up to three more before a rank blocked in a collective is stopped.
constexpr auto kExitBound = kFailureTimeout + std::chrono::seconds(10);

enum class Failure { killed_mid_step, killed_mid_collective, killed_mid_save, throws_mid_step };

// Which rank fails: the middle one (rank 2 of 4, rank 1 of 2).
int victim_of(const RankEnv& env) { return env.world_size() / 2; }
int victim_of(int world) { return world / 2; }

std::string failure_name(const ::testing::TestParamInfo<Failure>& info) {
  switch (info.param) {
    case Failure::killed_mid_step:
      return "KilledMidStep";
    case Failure::killed_mid_collective:
      return "KilledMidCollective";
    case Failure::killed_mid_save:
      return "KilledMidSave";
    case Failure::throws_mid_step:
      return "ThrowsMidStep";
  }
  return "?";
}

d9d::DistributedContext failing_context(const RankEnv& env) {
  // The backend's own timeout (step_timeout) is longer than the bound: it must not be what ends a
  // rank.
  return d9d::DistributedContext::from_env(
      {.init_timeout = std::chrono::seconds(60),
       .step_timeout = std::chrono::seconds(120),
       .failure_timeout = kFailureTimeout,
       .device = env.backend() == d9d::testing::Backend::nccl ? "cuda" : "cpu"});
}

// The victim notes when it fails: steady_clock is CLOCK_MONOTONIC, the same clock in every process
// of the machine, so the parent can compare it with when it saw each rank end.
void mark_failure(const RankEnv& env) {
  std::ofstream(env.scratch_dir() + "/failed_at") << Clock::now().time_since_epoch().count();
}

[[noreturn]] void die(const RankEnv& env) {
  mark_failure(env);
  std::raise(SIGKILL);
  std::abort();
}

using DpPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Fp64>;

// Data-parallel training of a tiny Qwen3; the victim fails in step 3, after its backward and
// gradient all-reduce, before its optimizer update: the others are in the same step.
void train_until_failure(RankEnv& env, const d9d::DistributedContext& ctx, Failure failure) {
  const std::string dir = env.scratch_dir() + "/rank" + std::to_string(env.rank());
  d9d::Trainer<DpPlan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, d9d::testing::tiny_run(dir, 1000, 8, 2));
  if (env.rank() == victim_of(env)) {
    trainer.on<d9d::events::BeforeOptimizer>(
        [&env, failure](const d9d::events::BeforeOptimizer& e) {
          if (e.step == 3) {
            if (failure == Failure::throws_mid_step) {
              mark_failure(env);
              throw std::runtime_error("rank " + std::to_string(env.rank()) +
                                       " gave up in step 3 (test)");
            }
            die(env);
          }
        });
  }
  (void)trainer.train();
}

// All-reduces of 8 MiB; the victim starts the sixth (Gloo runs it on its own thread, NCCL on the
// GPU) and dies while the others are in it.
void all_reduce_until_failure(RankEnv& env, const d9d::DistributedContext& ctx) {
  const auto big = at::ones({int64_t{2} << 20}, at::TensorOptions().device(ctx.device()));
  for (int i = 0;; ++i) {
    if (env.rank() == victim_of(env) && i == 5) {
      std::vector<at::Tensor> tensors{big.clone()};
      const auto work = ctx.world().backend()->allreduce(tensors);
      die(env);
    }
    (void)d9d::all_reduce(ctx.world(), big);
  }
}

// A distributed save; rank 2 dies after writing its file, before the commit, while the others wait
// for it to agree.
void save_until_failure(RankEnv& env, const d9d::DistributedContext& ctx) {
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_shard = 4});
  const d9d::state::DistributedState state{
      {"w",
       d9d::ShardedTensor::distribute(at::arange(4096.0).reshape({64, 64}), mesh,
                                      d9d::MeshDomain::regular, {"dp_shard"}, {d9d::Shard{0}})}};
  d9d::state::save_distributed(ctx, env.scratch_dir() + "/ckpt", state, {.before_commit = [&env] {
                                 if (env.rank() == victim_of(env)) {
                                   die(env);
                                 }
                               }});
}

// Runs `failure` on `world` ranks of `backend` and checks how every other rank ended.
void expect_others_exit_naming_the_victim(Failure failure, d9d::testing::Backend backend,
                                          int world) {
  const int victim_rank = victim_of(world);
  const std::string victim_name = "rank " + std::to_string(victim_rank);
  // The harness kills the others only long after the bound (grace_after_failure), so a rank that
  // is still running at the bound fails the test instead of being hidden by the harness's kill.
  const auto result =
      d9d::testing::launch({.world_size = world,
                            .backend = backend,
                            .timeout = std::chrono::minutes(3),
                            .grace_after_failure = kExitBound + std::chrono::seconds(30)},
                           [failure](RankEnv& env) {
                             const auto ctx = failing_context(env);
                             switch (failure) {
                               case Failure::killed_mid_step:
                               case Failure::throws_mid_step:
                                 train_until_failure(env, ctx, failure);
                                 break;
                               case Failure::killed_mid_collective:
                                 all_reduce_until_failure(env, ctx);
                                 break;
                               case Failure::killed_mid_save:
                                 save_until_failure(env, ctx);
                                 break;
                             }
                             ADD_FAILURE() << "rank " << env.rank() << " carried on after rank "
                                           << victim_of(env) << " failed";
                           });

  std::ifstream in(*result.scratch_dir + "/failed_at");
  long long ticks = 0;
  const bool read = static_cast<bool>(in >> ticks);
  ASSERT_TRUE(read) << victim_name << " never got to fail\n" << result.report();
  const Clock::time_point failed_at{Clock::duration(ticks)};

  const auto& victim = result.ranks[victim_rank];
  const std::string thrown = victim_name + " gave up in step 3 (test)";
  if (failure == Failure::throws_mid_step) {
    EXPECT_NE(victim.exit_code, 0) << result.report();
    EXPECT_THAT(victim.output, HasSubstr(thrown));
  } else {
    EXPECT_EQ(victim.term_signal, SIGKILL) << result.report();
  }
  const std::string verdict = failure == Failure::throws_mid_step
                                  ? "job failed: " + victim_name + " failed: " + thrown
                                  : "job failed: " + victim_name + " stopped heartbeating";
  for (const auto& rank : result.ranks) {
    if (rank.rank == victim_rank) {
      continue;
    }
    EXPECT_FALSE(rank.ok()) << rank.describe();
    EXPECT_FALSE(rank.killed_after_failure) << result.report();
    EXPECT_FALSE(rank.timed_out) << result.report();
    EXPECT_THAT(rank.output, HasSubstr(verdict)) << result.report();
    const double seconds =
        std::chrono::duration<double>(result.started + rank.ended_after - failed_at).count();
    EXPECT_LT(seconds, std::chrono::duration<double>(kExitBound).count()) << result.report();
    // The measured times, for the record (docs/core.md quotes them).
    const auto at = rank.output.find("job failed:");
    const auto line = at == std::string::npos
                          ? std::string()
                          : rank.output.substr(at, rank.output.find('\n', at) - at);
    std::printf("[  timing  ] %s, %.1f s after %s failed; it logged \"%s\"\n",
                rank.describe().c_str(), seconds, victim_name.c_str(), line.c_str());
    ::testing::Test::RecordProperty("rank" + std::to_string(rank.rank) + "_exit_after_ms",
                                    static_cast<int>(seconds * 1000));
  }
}

class Core_RankFailure_Gloo_ws4 : public ::testing::TestWithParam<Failure> {};

TEST_P(Core_RankFailure_Gloo_ws4, EveryOtherRankExitsNamingTheFailedRank) {
  expect_others_exit_naming_the_victim(GetParam(), d9d::testing::Backend::gloo, 4);
}

class Core_RankFailure_Nccl_ws2 : public ::testing::TestWithParam<Failure> {};

TEST_P(Core_RankFailure_Nccl_ws2, TheOtherRankExitsNamingTheFailedRank) {
  if (d9d::testing::default_backend() != d9d::testing::Backend::nccl) {
    GTEST_SKIP() << "NCCL only: runs with D9D_TEST_BACKEND=nccl on 2 GPUs (tools/gpu/check)";
  }
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs, " << torch::cuda::device_count() << " visible";
  }
  expect_others_exit_naming_the_victim(GetParam(), d9d::testing::Backend::nccl, 2);
}

INSTANTIATE_TEST_SUITE_P(Points, Core_RankFailure_Nccl_ws2,
                         ::testing::Values(Failure::killed_mid_step,
                                           Failure::killed_mid_collective),
                         failure_name);

INSTANTIATE_TEST_SUITE_P(Points, Core_RankFailure_Gloo_ws4,
                         ::testing::Values(Failure::killed_mid_step, Failure::killed_mid_collective,
                                           Failure::killed_mid_save, Failure::throws_mid_step),
                         failure_name);

}  // namespace
