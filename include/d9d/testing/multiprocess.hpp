// d9d/testing/multiprocess.hpp — run a GoogleTest body on N ranks as separate processes.
//
//   TEST(Collectives_Gloo_ws2, AllReduceSums) {
//     d9d::testing::run_on_ranks({.world_size = 2}, [](d9d::testing::RankEnv& env) { ... });
//   }
//
// The parent process re-executes the test binary once per rank, filtered to the current test, with
// the torchrun variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE=True since the parent serves the store), so
// d9d::DistributedContext::from_env() works inside a rank. Each child runs the same TEST body;
// `launch` sees it is a rank and runs `body` there, with a c10d store (TCP on loopback, hosted by
// the parent on a free port, or a file store) and a lazily created process group (Gloo on CPU, NCCL
// on GPU). The parent collects every rank's exit status and output; a failing, crashing or hanging
// rank fails the test, shows that rank's output, and no rank (nor anything a rank started in its
// process group) outlives the launch.
//
// Rule: one launch per TEST body (a second one is reported as a failure); vary the world size with
// parameterised tests. Code before the launch runs in every rank too, so it must be deterministic.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
class Backend;
}  // namespace c10d

namespace d9d::testing {

/// Which collective backend `RankEnv::process_group()` creates.
enum class Backend { gloo, nccl };

/// How the ranks meet: a TCP store on 127.0.0.1 (hosted by the parent) or a file store.
enum class Rendezvous { tcp, file };

/// Backend::nccl when the environment says D9D_TEST_BACKEND=nccl (GPU runs), else Backend::gloo:
/// the same tests run on CPU in CI and with NCCL on a GPU machine.
[[nodiscard]] Backend default_backend();

/// Options of one multi-process launch; fill with designated initialisers.
struct LaunchOptions {
  int world_size = 2;
  Backend backend = default_backend();
  Rendezvous rendezvous = Rendezvous::tcp;
  /// Wall-clock limit for the whole launch; ranks still running then are killed. Overridden by
  /// the environment variable D9D_TEST_TIMEOUT_S when that is larger (slow machines).
  std::chrono::milliseconds timeout{std::chrono::seconds{120}};
  /// After the first rank fails, the others get this long to finish (and print) before they are
  /// killed: a failed rank usually leaves its peers blocked in a collective.
  std::chrono::milliseconds grace_after_failure{std::chrono::seconds{3}};
};

/// What the body sees inside one rank.
class RankEnv {
 public:
  RankEnv(int rank, int world_size, Backend backend, std::string scratch_dir);
  ~RankEnv();
  RankEnv(const RankEnv&) = delete;
  RankEnv& operator=(const RankEnv&) = delete;
  RankEnv(RankEnv&&) = delete;
  RankEnv& operator=(RankEnv&&) = delete;

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int world_size() const { return world_size_; }
  [[nodiscard]] Backend backend() const { return backend_; }
  /// A directory shared by all ranks of this launch (and visible to the parent's result).
  [[nodiscard]] const std::string& scratch_dir() const { return scratch_dir_; }
  /// The store every rank of this launch is connected to (created on first use).
  [[nodiscard]] c10d::Store& store();
  /// A process group over all ranks (Gloo or NCCL, created on first use, cached).
  [[nodiscard]] c10d::Backend& process_group();

 private:
  struct State;
  int rank_;
  int world_size_;
  Backend backend_;
  std::string scratch_dir_;
  std::unique_ptr<State> state_;
};

/// How one rank ended.
struct RankOutcome {
  int rank = 0;
  int exit_code = -1;                 ///< exit status when the rank exited, else -1
  int term_signal = 0;                ///< the signal that ended it, else 0
  bool timed_out = false;             ///< still running at the launch timeout, killed
  bool killed_after_failure = false;  ///< killed because another rank failed first
  std::string output;                 ///< the rank's stdout and stderr, interleaved
  /// When the parent saw the rank end, from the start of the launch (polled every 10 ms).
  std::chrono::milliseconds ended_after{-1};
  [[nodiscard]] bool ok() const { return exit_code == 0 && term_signal == 0 && !timed_out; }
  [[nodiscard]] std::string describe() const;
};

/// The result of a launch, seen by the parent process.
struct LaunchResult {
  std::vector<RankOutcome> ranks;
  std::vector<int> pids;  ///< the ranks' process ids (all reaped when `launch` returns)
  std::chrono::milliseconds elapsed{0};
  /// When the ranks were started (steady_clock is CLOCK_MONOTONIC, the same in every process).
  std::chrono::steady_clock::time_point started{};
  std::shared_ptr<const std::string> scratch_dir;  ///< removed when the last copy goes away
  [[nodiscard]] bool ok() const;
  /// Human-readable summary with the output of every rank that did not end well.
  [[nodiscard]] std::string report() const;
};

using RankBody = std::function<void(RankEnv&)>;

/// True inside a rank process started by `launch`.
[[nodiscard]] bool is_rank_process();

/// Runs `body` on `options.world_size` ranks. In the parent: starts the ranks, waits, returns how
/// each ended. In a rank: runs `body`, then ends the process (exit code 0 when the body raised no
/// GoogleTest failure and threw nothing), so it never returns there.
LaunchResult launch(const LaunchOptions& options, const RankBody& body);

/// `launch`, then a GoogleTest failure carrying `report()` unless every rank ended well.
void run_on_ranks(const LaunchOptions& options, const RankBody& body);

}  // namespace d9d::testing
