// Tests of the multi-process harness itself: correct collectives on 2 and 4 ranks, and every
// failure mode (failing, throwing, crashing, hanging ranks; peers blocked by a failed rank;
// processes a rank started) is caught and cleaned up.
#include <cerrno>
#include <chrono>
#include <fstream>
#include <signal.h>
#include <thread>
#include <tuple>
#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/testing/multiprocess.hpp>

namespace {

using d9d::testing::RankEnv;
using d9d::testing::Rendezvous;
using namespace std::chrono_literals;

// True once `pid` no longer exists (it was reaped), waiting up to 10 s for the kernel to finish.
bool process_gone(pid_t pid) {
  for (int i = 0; i < 1000; ++i) {
    if (::kill(pid, 0) == -1 && errno == ESRCH) {
      return true;
    }
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

void expect_all_gone(const d9d::testing::LaunchResult& result) {
  for (const pid_t pid : result.pids) {
    EXPECT_TRUE(process_gone(pid)) << "rank process " << pid << " outlived the launch";
  }
}

// Starts a process in the rank's process group that would sleep for an hour; returns its pid.
pid_t start_sleeper() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::sleep(3600);
    ::_exit(0);
  }
  return pid;
}

void write_pid(const std::string& path, pid_t pid) {
  std::ofstream out(path);
  out << pid << "\n";
}

pid_t read_pid(const std::string& path) {
  std::ifstream in(path);
  pid_t pid = -1;
  in >> pid;
  return pid;
}

class Harness_Gloo : public ::testing::TestWithParam<std::tuple<int, Rendezvous>> {};

TEST_P(Harness_Gloo, AllReduceSumsAcrossRanks) {
  const auto [world, rendezvous] = GetParam();
  d9d::testing::run_on_ranks(
      {.world_size = world, .rendezvous = rendezvous}, [world = world](RankEnv& env) {
        ASSERT_EQ(env.world_size(), world);
        std::vector<at::Tensor> tensors = {at::arange(5, at::kFloat) * (env.rank() + 1)};
        env.process_group().allreduce(tensors)->wait();
        const double factor = world * (world + 1) / 2.0;
        EXPECT_TRUE(at::equal(tensors[0], at::arange(5, at::kFloat) * factor))
            << "rank " << env.rank() << " got " << tensors[0];
      });
}

INSTANTIATE_TEST_SUITE_P(Stores, Harness_Gloo,
                         ::testing::Values(std::make_tuple(1, Rendezvous::tcp),
                                           std::make_tuple(2, Rendezvous::tcp),
                                           std::make_tuple(4, Rendezvous::tcp),
                                           std::make_tuple(2, Rendezvous::file),
                                           std::make_tuple(4, Rendezvous::file)),
                         [](const auto& info) {
                           return "ws" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == Rendezvous::tcp ? "_tcp" : "_file");
                         });

TEST(Harness_Env, RanksSeeTorchrunVariables) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    EXPECT_EQ(std::getenv("RANK"), std::to_string(env.rank()));  // NOLINT(concurrency-mt-unsafe)
    EXPECT_STREQ(std::getenv("WORLD_SIZE"), "2");                // NOLINT(concurrency-mt-unsafe)
    EXPECT_STREQ(std::getenv("MASTER_ADDR"), "127.0.0.1");       // NOLINT(concurrency-mt-unsafe)
    EXPECT_NE(std::getenv("MASTER_PORT"), nullptr);              // NOLINT(concurrency-mt-unsafe)
    // The ranks meet in the store: each writes its key, then reads the other's.
    env.store().set("key" + std::to_string(env.rank()),
                    std::vector<uint8_t>{static_cast<uint8_t>(env.rank())});
    const auto other = env.store().get("key" + std::to_string(1 - env.rank()));
    ASSERT_EQ(other.size(), 1U);
    EXPECT_EQ(other[0], 1 - env.rank());
  });
}

TEST(Harness_FailureModes, FailingRankFailsTheLaunch) {
  const auto result = d9d::testing::launch({.world_size = 2}, [](RankEnv& env) {
    if (env.rank() == 1) {
      ADD_FAILURE() << "planted failure on rank 1";
    }
  });
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.ranks[0].ok()) << result.report();
  EXPECT_EQ(result.ranks[1].exit_code, 1) << result.report();
  EXPECT_NE(result.ranks[1].output.find("planted failure on rank 1"), std::string::npos);
  EXPECT_NE(result.report().find("planted failure on rank 1"), std::string::npos);
  EXPECT_NE(result.report().find("rank 1: exited with code 1"), std::string::npos);
  expect_all_gone(result);
}

TEST(Harness_FailureModes, ThrowingRankFailsTheLaunch) {
  const auto result = d9d::testing::launch({.world_size = 2}, [](RankEnv& env) {
    if (env.rank() == 0) {
      throw std::runtime_error("planted exception on rank 0");
    }
  });
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.ranks[0].exit_code, 0);
  EXPECT_NE(result.ranks[0].output.find("planted exception on rank 0"), std::string::npos)
      << result.report();
  EXPECT_TRUE(result.ranks[1].ok()) << result.report();
  expect_all_gone(result);
}

TEST(Harness_FailureModes, CrashingRankFailsTheLaunch) {
  const auto result = d9d::testing::launch({.world_size = 2}, [](RankEnv& env) {
    if (env.rank() == 1) {
      std::abort();
    }
  });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.ranks[1].term_signal, SIGABRT) << result.report();
  expect_all_gone(result);
}

TEST(Harness_FailureModes, HangingRankIsKilledAtTheTimeout) {
  const auto result = d9d::testing::launch({.world_size = 2, .timeout = 2s}, [](RankEnv& env) {
    if (env.rank() == 1) {
      std::printf("rank 1 going to sleep\n");
      std::fflush(stdout);
      std::this_thread::sleep_for(1h);
    }
  });
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.ranks[0].ok()) << result.report();
  EXPECT_TRUE(result.ranks[1].timed_out) << result.report();
  EXPECT_NE(result.report().find("rank 1 going to sleep"), std::string::npos);
  // Correctness bound, not a speed target: the launch ended because of the timeout, not the sleep.
  EXPECT_LT(result.elapsed, 10min);
  expect_all_gone(result);
}

TEST(Harness_FailureModes, PeersBlockedByAFailedRankAreKilled) {
  // Rank 1 fails before the collective; rank 0 would wait in it until the 1 h launch timeout.
  const auto result = d9d::testing::launch(
      {.world_size = 2, .timeout = 1h, .grace_after_failure = 1s}, [](RankEnv& env) {
        if (env.rank() == 1) {
          ADD_FAILURE() << "planted failure before the collective";
          return;
        }
        std::vector<at::Tensor> tensors = {at::ones({4})};
        env.process_group().allreduce(tensors)->wait();
      });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.ranks[1].exit_code, 1) << result.report();
  EXPECT_TRUE(result.ranks[0].killed_after_failure || !result.ranks[0].ok()) << result.report();
  EXPECT_LT(result.elapsed, 10min);
  expect_all_gone(result);
}

TEST(Harness_FailureModes, NoProcessOutlivesTheLaunch) {
  // Rank 0 leaves a child behind and exits well; rank 1 starts one and hangs.
  const auto result = d9d::testing::launch({.world_size = 2, .timeout = 3s}, [](RankEnv& env) {
    const pid_t sleeper = start_sleeper();
    write_pid(env.scratch_dir() + "/sleeper" + std::to_string(env.rank()) + ".pid", sleeper);
    if (env.rank() == 1) {
      std::this_thread::sleep_for(1h);
    }
  });
  EXPECT_TRUE(result.ranks[0].ok()) << result.report();
  EXPECT_TRUE(result.ranks[1].timed_out) << result.report();
  expect_all_gone(result);
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t sleeper =
        read_pid(*result.scratch_dir + "/sleeper" + std::to_string(rank) + ".pid");
    ASSERT_GT(sleeper, 0) << "rank " << rank << " did not record its child";
    EXPECT_TRUE(process_gone(sleeper)) << "rank " << rank << "'s child " << sleeper << " survived";
  }
}

}  // namespace
