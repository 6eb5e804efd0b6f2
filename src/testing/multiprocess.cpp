// d9d/testing/multiprocess.cpp — the multi-process test harness (see the header for the contract).
#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <d9d/testing/multiprocess.hpp>
#include <d9d/util/files.hpp>

#ifdef D9D_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

extern char**
    environ;  // NOLINT(readability-redundant-declaration): POSIX, not declared by <unistd.h>

namespace d9d::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kRankVar = "D9D_TEST_RANK";
constexpr std::string_view kStoreVar = "D9D_TEST_STORE";
constexpr std::string_view kScratchVar = "D9D_TEST_SCRATCH";
constexpr std::string_view kTimeoutVar = "D9D_TEST_TIMEOUT_S";
constexpr std::size_t kReportTailBytes = 16384;

std::optional<std::string> get_env(std::string_view name) {
  const char* value = std::getenv(std::string(name).c_str());  // NOLINT(concurrency-mt-unsafe)
  if (value == nullptr) {
    return std::nullopt;
  }
  return std::string(value);
}

int env_int(std::string_view name) {
  auto value = get_env(name);
  if (!value) {
    throw std::runtime_error("d9d::testing: rank process without " + std::string(name));
  }
  return std::stoi(*value);
}

std::chrono::milliseconds effective_timeout(const LaunchOptions& options) {
  auto timeout = options.timeout;
  if (auto env = get_env(kTimeoutVar)) {
    const auto from_env = std::chrono::milliseconds(std::llround(std::stod(*env) * 1000.0));
    timeout = std::max(timeout, from_env);
  }
  return timeout;
}

// Variables a rank must not inherit: they would make it write the parent's test report, run
// another shard or filter, or pretend it finished the parent's test run.
bool is_private_to_parent(std::string_view entry) {
  constexpr std::array<std::string_view, 12> kDropped = {
      "XML_OUTPUT_FILE",          "GTEST_OUTPUT",       "TESTBRIDGE_TEST_ONLY",
      "TEST_SHARD_INDEX",         "TEST_TOTAL_SHARDS",  "TEST_SHARD_STATUS_FILE",
      "GTEST_SHARD_INDEX",        "GTEST_TOTAL_SHARDS", "GTEST_SHARD_STATUS_FILE",
      "TEST_PREMATURE_EXIT_FILE", "GTEST_FILTER",       "TORCHELASTIC_USE_AGENT_STORE"};
  const auto name = entry.substr(0, entry.find('='));
  return std::find(kDropped.begin(), kDropped.end(), name) != kDropped.end();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string make_scratch_dir() {
  std::string base = get_env("TEST_TMPDIR").value_or("/tmp");
  std::string pattern = base + "/d9d-launch-XXXXXX";
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {
    throw std::runtime_error("d9d::testing: mkdtemp(" + pattern +
                             ") failed: " + std::strerror(errno));
  }
  return {buffer.data()};
}

// Sends SIGKILL to a rank's whole process group (the rank and whatever it started there).
void kill_group(pid_t pgid) {
  if (pgid > 0) {
    ::kill(-pgid, SIGKILL);
  }
}

struct RunningRank {
  pid_t pid = -1;
  bool alive = false;
  std::string log_path;
};

// The parent side: the rank processes of one launch. Kills whatever is left on destruction.
class RankProcesses {
 public:
  RankProcesses() = default;
  RankProcesses(const RankProcesses&) = delete;
  RankProcesses& operator=(const RankProcesses&) = delete;
  RankProcesses(RankProcesses&&) = delete;
  RankProcesses& operator=(RankProcesses&&) = delete;
  ~RankProcesses() {
    for (auto& rank : ranks_) {
      if (rank.alive) {
        kill_group(rank.pid);
        int status = 0;
        ::waitpid(rank.pid, &status, 0);
        rank.alive = false;
      }
      kill_group(rank.pid);
    }
    reap_orphans();
  }

  void start(const std::string& exe, const std::vector<std::string>& args,
             const std::vector<std::string>& env, const std::string& log_path) {
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (const auto& arg : args) {
      argv.push_back(
          const_cast<char*>(arg.c_str()));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    }
    argv.push_back(nullptr);
    std::vector<char*> envp;
    envp.reserve(env.size() + 1);
    for (const auto& entry : env) {
      envp.push_back(
          const_cast<char*>(entry.c_str()));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    }
    envp.push_back(nullptr);

    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-vararg)
    const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      throw std::runtime_error("d9d::testing: cannot open " + log_path + ": " +
                               std::strerror(errno));
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(log_fd);
      throw std::runtime_error(std::string("d9d::testing: fork failed: ") + std::strerror(errno));
    }
    if (pid == 0) {
      // Child: only async-signal-safe calls until execve.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // NOLINT(cppcoreguidelines-pro-type-vararg)
      if (::getppid() != parent) {
        ::_exit(127);
      }
      const int null_fd =
          ::open("/dev/null", O_RDONLY);  // NOLINT(cppcoreguidelines-pro-type-vararg)
      ::dup2(null_fd, STDIN_FILENO);
      ::dup2(log_fd, STDOUT_FILENO);
      ::dup2(log_fd, STDERR_FILENO);
      ::execve(exe.c_str(), argv.data(), envp.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from the parent, so a kill right after fork reaches the group
    ::close(log_fd);
    ranks_.push_back(RunningRank{.pid = pid, .alive = true, .log_path = log_path});
  }

  std::vector<RunningRank>& ranks() { return ranks_; }

 private:
  // With the harness as child subreaper, processes the ranks started end up as our children when
  // their rank dies; collect them so none is left as a zombie.
  // A killed process is gone only once reaped; give the kernel up to 2 s to deliver the kills.
  static void reap_orphans() {
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (true) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        continue;
      }
      if (pid < 0 || Clock::now() >= deadline) {
        return;  // ECHILD: no children left
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  std::vector<RunningRank> ranks_;
};

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) {
    throw std::logic_error("d9d::testing::launch must be called from inside a TEST body");
  }
  return std::string(info->test_suite_name()) + "." + info->name();
}

// readlink rather than std::filesystem (see d9d/util/files.hpp).
std::string self_exe() {
  std::array<char, 4096> buffer{};
  const ssize_t length = ::readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  if (length <= 0) {
    throw std::runtime_error(std::string("d9d::testing: cannot resolve /proc/self/exe: ") +
                             std::strerror(errno));
  }
  return {buffer.data(), static_cast<std::size_t>(length)};
}

[[noreturn]] void run_as_rank(const LaunchOptions& options, const RankBody& body) {
  const int rank = env_int("RANK");
  const int world = env_int("WORLD_SIZE");
  int code = 0;
  try {
    if (world != options.world_size) {
      throw std::runtime_error("rank started with WORLD_SIZE=" + std::to_string(world) +
                               " but the launch asks for " + std::to_string(options.world_size));
    }
    RankEnv env(rank, world, options.backend, get_env(kScratchVar).value_or("/tmp"));
    body(env);
    std::fflush(stdout);
    std::fflush(stderr);
    // The process group and store are left to process exit: tearing down a group whose peers
    // may already be gone can block.
    if (::testing::Test::HasFailure()) {
      code = 1;
    }
    std::_Exit(code);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[d9d rank %d] uncaught exception: %s\n", rank, error.what());
    code = 3;
  } catch (...) {
    std::fprintf(stderr, "[d9d rank %d] uncaught non-standard exception\n", rank);
    code = 3;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

std::string tail(const std::string& text, std::size_t bytes) {
  if (text.size() <= bytes) {
    return text;
  }
  return "[... " + std::to_string(text.size() - bytes) + " bytes cut ...]\n" +
         text.substr(text.size() - bytes);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// RankEnv

struct RankEnv::State {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> group;
};

RankEnv::RankEnv(int rank, int world_size, Backend backend, std::string scratch_dir)
    : rank_(rank),
      world_size_(world_size),
      backend_(backend),
      scratch_dir_(std::move(scratch_dir)),
      state_(std::make_unique<State>()) {}

RankEnv::~RankEnv() = default;

c10d::Store& RankEnv::store() {
  if (!state_->store) {
    const std::string spec = get_env(kStoreVar).value_or("tcp");
    if (spec == "tcp") {
      c10d::TCPStoreOptions options;
      options.port = static_cast<std::uint16_t>(env_int("MASTER_PORT"));
      options.isServer = false;
      options.waitWorkers = false;
      options.timeout = std::chrono::seconds(60);
      state_->store = c10::make_intrusive<c10d::TCPStore>(
          get_env("MASTER_ADDR").value_or("127.0.0.1"), options);
    } else if (spec.rfind("file:", 0) == 0) {
      state_->store = c10::make_intrusive<c10d::FileStore>(spec.substr(5), world_size_);
    } else {
      throw std::runtime_error("d9d::testing: unknown " + std::string(kStoreVar) + "=" + spec);
    }
  }
  return *state_->store;
}

c10d::Backend& RankEnv::process_group() {
  if (!state_->group) {
    (void)store();
    if (backend_ == Backend::gloo) {
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      state_->group =
          c10::make_intrusive<c10d::ProcessGroupGloo>(state_->store, rank_, world_size_, options);
    } else {
#ifdef D9D_WITH_NCCL
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(env_int("LOCAL_RANK")));
      auto options = c10d::ProcessGroupNCCL::Options::create();
      state_->group =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(state_->store, rank_, world_size_, options);
#else
      throw std::runtime_error(
          "d9d::testing: Backend::nccl needs a build with CUDA (D9D_WITH_NCCL); this one has none");
#endif
    }
  }
  return *state_->group;
}

// ------------------------------------------------------------------------------------------------
// Outcomes

std::string RankOutcome::describe() const {
  std::string what = "rank " + std::to_string(rank) + ": ";
  if (timed_out) {
    return what + "still running at the launch timeout (hang?), killed";
  }
  if (killed_after_failure) {
    return what + "killed after another rank failed";
  }
  if (term_signal != 0) {
    return what + "killed by signal " + std::to_string(term_signal) + " (" +
           strsignal(term_signal) + ")";  // NOLINT(concurrency-mt-unsafe)
  }
  if (exit_code == 0) {
    return what + "ok";
  }
  return what + "exited with code " + std::to_string(exit_code);
}

bool LaunchResult::ok() const {
  return !ranks.empty() &&
         std::all_of(ranks.begin(), ranks.end(), [](const RankOutcome& r) { return r.ok(); });
}

std::string LaunchResult::report() const {
  std::ostringstream out;
  out << "launch of " << ranks.size() << " rank(s) " << (ok() ? "succeeded" : "FAILED") << " after "
      << elapsed.count() << " ms\n";
  for (const auto& rank : ranks) {
    out << "  " << rank.describe() << "\n";
  }
  for (const auto& rank : ranks) {
    if (!rank.ok()) {
      out << "----- output of rank " << rank.rank << " -----\n"
          << tail(rank.output, kReportTailBytes) << "\n----- end of rank " << rank.rank
          << " -----\n";
    }
  }
  return out.str();
}

// ------------------------------------------------------------------------------------------------
// launch

bool is_rank_process() { return get_env(kRankVar).has_value(); }

Backend default_backend() {
  return get_env("D9D_TEST_BACKEND").value_or("gloo") == "nccl" ? Backend::nccl : Backend::gloo;
}

LaunchResult launch(const LaunchOptions& options, const RankBody& body) {
  if (is_rank_process()) {
    run_as_rank(options, body);
  }
  if (options.world_size < 1) {
    throw std::invalid_argument("d9d::testing::launch: world_size must be >= 1, got " +
                                std::to_string(options.world_size));
  }
  const std::string filter = current_test_filter();
  static std::string last_test;  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables)
  if (last_test == filter) {
    ADD_FAILURE() << "d9d::testing::launch called twice in " << filter
                  << "; use one launch per TEST (parameterise the test instead)";
  }
  last_test = filter;

  // Orphans of a dying rank become our children, so the destructor can reap them.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);  // NOLINT(cppcoreguidelines-pro-type-vararg)

  const auto timeout = effective_timeout(options);
  const std::string scratch = make_scratch_dir();
  LaunchResult result;
  result.scratch_dir =
      std::shared_ptr<const std::string>(new std::string(scratch), [](const std::string* path) {
        d9d::files::remove_tree(*path);
        delete path;  // NOLINT(cppcoreguidelines-owning-memory)
      });

  // The rendezvous: a TCP store served from this process on a free port, or a file.
  c10::intrusive_ptr<c10d::TCPStore> server;
  std::string store_spec = "tcp";
  int port = 0;
  if (options.rendezvous == Rendezvous::tcp) {
    c10d::TCPStoreOptions store_options;
    store_options.port = 0;
    store_options.isServer = true;
    store_options.waitWorkers = false;
    store_options.timeout = timeout;
    server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
    port = server->getPort();
  } else {
    store_spec = "file:" + scratch + "/store";
  }

  std::vector<std::string> base_env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-bounds-pointer-arithmetic)
    if (!is_private_to_parent(*entry)) {
      base_env.emplace_back(*entry);
    }
  }
  const std::string exe = self_exe();
  const std::vector<std::string> args = {exe, "--gtest_filter=" + filter, "--gtest_color=no"};

  const auto start = Clock::now();
  result.started = start;
  RankProcesses processes;
  for (int rank = 0; rank < options.world_size; ++rank) {
    std::vector<std::string> env = base_env;
    env.push_back(std::string(kRankVar) + "=" + std::to_string(rank));
    env.push_back(std::string(kStoreVar) + "=" + store_spec);
    env.push_back(std::string(kScratchVar) + "=" + scratch);
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("WORLD_SIZE=" + std::to_string(options.world_size));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(options.world_size));
    env.emplace_back("MASTER_ADDR=127.0.0.1");
    // The parent serves the store, as torchrun's agent does: every rank connects as a client.
    env.emplace_back("TORCHELASTIC_USE_AGENT_STORE=True");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    processes.start(exe, args, env, scratch + "/rank" + std::to_string(rank) + ".log");
  }

  auto& ranks = processes.ranks();
  result.ranks.resize(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    result.ranks[i].rank = static_cast<int>(i);
    result.pids.push_back(ranks[i].pid);
  }

  const auto record = [&](std::size_t i, int status) {
    auto& outcome = result.ranks[i];
    if (WIFEXITED(status)) {
      outcome.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      outcome.term_signal = WTERMSIG(status);
    }
    outcome.ended_after =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    ranks[i].alive = false;
  };
  const auto kill_and_reap = [&](std::size_t i) {
    kill_group(ranks[i].pid);
    int status = 0;
    ::waitpid(ranks[i].pid, &status, 0);
    result.ranks[i].ended_after =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    ranks[i].alive = false;
  };

  std::optional<Clock::time_point> first_failure;
  std::size_t alive = ranks.size();
  while (alive > 0) {
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (!ranks[i].alive) {
        continue;
      }
      int status = 0;
      if (::waitpid(ranks[i].pid, &status, WNOHANG) == ranks[i].pid) {
        record(i, status);
        --alive;
        if (!result.ranks[i].ok() && !first_failure) {
          first_failure = Clock::now();
        }
      }
    }
    if (alive == 0) {
      break;
    }
    const auto now = Clock::now();
    const bool timed_out = now - start >= timeout;
    const bool grace_over = first_failure && now - *first_failure >= options.grace_after_failure;
    if (timed_out || grace_over) {
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i].alive) {
          kill_and_reap(i);
          (timed_out && !grace_over ? result.ranks[i].timed_out
                                    : result.ranks[i].killed_after_failure) = true;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    kill_group(ranks[i].pid);  // anything a finished rank left behind in its group
    result.ranks[i].output = read_file(ranks[i].log_path);
  }
  return result;
}

void run_on_ranks(const LaunchOptions& options, const RankBody& body) {
  const auto result = launch(options, body);
  if (!result.ok()) {
    ADD_FAILURE() << result.report();
  }
}

}  // namespace d9d::testing
