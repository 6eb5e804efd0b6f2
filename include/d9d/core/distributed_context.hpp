// d9d/core/distributed_context.hpp — who this process is in the job, and how it talks to the rest.
//
//   auto ctx = d9d::DistributedContext::from_env();   // torchrun, Slurm, or local (world 1)
//   ctx.logger().info("starting");                     // "[d9d rank 0/8 ...] starting"
//   ctx.main_process_first([&] { prepare_dataset(); });
//
// From the environment: torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; else Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (with
// MASTER_ADDR / SLURM_LAUNCH_NODE_IPADDR and MASTER_PORT or a port derived from SLURM_JOB_ID);
// else local mode: one process, no store, no process group. The device is cuda:LOCAL_RANK when
// this build has CUDA and a GPU is visible, else cpu; the backend follows the device (NCCL / Gloo).
// A context is a shared handle: pass it explicitly; copies share the same groups and logger.
//
// Store keys: every context of a world > 1 keeps its keys under its own prefix
// ("d9d/ctx<k>-of-<n>/" with k counting the unnamed contexts of a world > 1 this process created,
// or ContextOptions::name), so several contexts in one process never collide: create them in the
// same order on every rank.
//
// A dying rank never hangs the job: each rank heartbeats through the store and a watchdog thread
// watches one peer (the next rank). When a rank stops heartbeating for `failure_timeout` (killed,
// crashed), or reports a failure (its context is destroyed by an exception, the process terminates
// on one, or report_failure is called), every other rank logs "... rank R failed: <why>" and
// exits with kPeerFailureExitCode within about failure_timeout + 6 heartbeat intervals, unless it
// is already leaving by an exception of its own (then it logs the same and goes on unwinding).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>

#include <d9d/core/process_group.hpp>

namespace d9d {

/// How the process was started.
enum class Launcher { local, torchrun, slurm };

/// Where the process sits in the job, as read from the environment (see parse_launch_env).
struct LaunchInfo {
  Launcher launcher = Launcher::local;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  /// torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank is a client.
  bool agent_store = false;
  /// torchrun's TORCHELASTIC_RESTART_COUNT: a restarted job keeps its keys apart from the last try.
  int restart_count = 0;
};

/// The exit status of a process stopped by its watchdog because another rank failed (EX_TEMPFAIL:
/// the job may be restarted).
inline constexpr int kPeerFailureExitCode = 75;

/// Reads the launch variables through `getenv` (a function returning a variable's value, if set).
/// Throws std::invalid_argument naming the variable when one is malformed or inconsistent.
LaunchInfo parse_launch_env(
    const std::function<std::optional<std::string>(std::string_view)>& getenv);

/// Knobs of a context; fill with designated initialisers.
struct ContextOptions {
  /// Limit for connecting to the store and creating process groups.
  std::chrono::milliseconds init_timeout{std::chrono::minutes(10)};
  /// Limit for one collective once running (shorter: a stuck step should fail, not hang).
  std::chrono::milliseconds step_timeout{std::chrono::minutes(5)};
  /// A rank silent for this long (no heartbeat through the store) is declared dead and the others
  /// stop (see the file comment); heartbeats go every failure_timeout / 10 (at most 1 s). Zero:
  /// no heartbeat and no watchdog (failures then surface only as collective errors or timeouts).
  std::chrono::milliseconds failure_timeout{std::chrono::seconds(60)};
  /// The prefix of this context's store keys; empty: "ctx<k>-of-<world>" (k: the unnamed contexts
  /// of a world > 1 this process created before). Name contexts that not every rank creates.
  std::string name{};
  /// "cpu", "cuda" (cuda:LOCAL_RANK) or a full device string; default: cuda when usable, else cpu.
  std::optional<std::string> device;
};

/// Lines prefixed with the rank and, once a mesh exists, its mesh coordinates.
class Logger {
 public:
  struct State;
  explicit Logger(std::shared_ptr<State> state) : state_(std::move(state)) {}

  void info(std::string_view message) const;
  void warning(std::string_view message) const;
  void error(std::string_view message) const;
  /// Only the main process (rank 0) prints.
  void info_main(std::string_view message) const;
  /// The prefix every line starts with, e.g. "[d9d rank 3/8 | pp=0 dp_shard=1 tp=1]".
  [[nodiscard]] std::string prefix() const;
  /// Sets the coordinates part of the prefix (DeviceMesh does this).
  void set_coordinates(std::string coordinates) const;

 private:
  std::shared_ptr<State> state_;
};

/// The job as seen by one process: rank, world, device, backend, timeouts, process groups.
class DistributedContext {
 public:
  struct Impl;

  /// Reads the environment (torchrun / Slurm / local), connects to the store and creates the world
  /// group when the world has more than one rank.
  static DistributedContext from_env(const ContextOptions& options = {});
  /// One process, no communication.
  static DistributedContext local(const ContextOptions& options = {});
  /// From explicit launch facts (what from_env does after parse_launch_env).
  static DistributedContext from_launch(const LaunchInfo& launch,
                                        const ContextOptions& options = {});

  [[nodiscard]] int rank() const;
  [[nodiscard]] int world_size() const;
  [[nodiscard]] int local_rank() const;
  [[nodiscard]] int local_world_size() const;
  [[nodiscard]] Launcher launcher() const;
  [[nodiscard]] c10::Device device() const;
  /// "nccl", "gloo", or "none" (world of one).
  [[nodiscard]] std::string backend_name() const;
  [[nodiscard]] std::chrono::milliseconds init_timeout() const;
  [[nodiscard]] std::chrono::milliseconds step_timeout() const;
  [[nodiscard]] std::chrono::milliseconds failure_timeout() const;
  /// Changes the failure timeout from now on (e.g. from a trainer config); give every rank the
  /// same.
  void set_failure_timeout(std::chrono::milliseconds timeout) const;
  /// The prefix of this context's store keys, e.g. "d9d/ctx0-of-4/" ("" for a world of one).
  [[nodiscard]] const std::string& store_prefix() const;
  [[nodiscard]] bool is_main_process() const { return rank() == 0; }
  [[nodiscard]] bool is_local_main_process() const { return local_rank() == 0; }

  /// All ranks.
  [[nodiscard]] const ProcessGroup& world() const;
  /// The group of `ranks` (sorted, unique, containing this rank), created on first request and
  /// cached. Creation is collective over the members: request groups in the same order everywhere.
  [[nodiscard]] ProcessGroup group(const std::vector<int>& ranks, std::string name = {}) const;
  /// Blocks until every rank reached it.
  void barrier() const;
  /// Runs `fn` on the main process first, then on the others (e.g. a download or a cache build).
  template <class Fn>
  void main_process_first(Fn&& fn) const {
    if (is_main_process()) {
      fn();
    }
    barrier();
    if (!is_main_process()) {
      fn();
    }
  }
  /// The same per node: the local main process of each node first.
  template <class Fn>
  void local_main_process_first(Fn&& fn) const {
    if (is_local_main_process()) {
      fn();
    }
    barrier();
    if (!is_local_main_process()) {
      fn();
    }
  }

  [[nodiscard]] const Logger& logger() const;

  /// Tells every other rank that this one is failing with `message` (call it before leaving on an
  /// error the others do not know about), then waits, at most failure_timeout + 5 heartbeat
  /// intervals, until every rank has reported, stopped or been found dead, and returns the verdict
  /// it logged: "rank R failed: <message>" for the first report, or "rank R stopped heartbeating
  /// ..." when a rank died. Only the first call does anything; "" for a world of one or without a
  /// watchdog. The context does it itself when it is destroyed by an exception or the process
  /// terminates on one.
  std::string report_failure(std::string_view message) const;
  /// Keeps `message` as the text report_failure sends if this context is destroyed by an exception
  /// (Trainer::train notes every exception leaving it); nothing is sent now.
  void note_failure(std::string_view message) const;

 private:
  explicit DistributedContext(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace d9d
