// d9d/core/distributed_context.cpp — launch-environment parsing, store, process groups, logger.
#include <algorithm>
#include <atomic>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <d9d/core/detail/watchdog.hpp>
#include <d9d/core/distributed_context.hpp>

#ifdef D9D_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace d9d {

// ------------------------------------------------------------------------------------------------
// ProcessGroup

struct ProcessGroup::Impl {
  std::vector<int> ranks;
  int rank = 0;
  c10::intrusive_ptr<c10d::Backend> backend;
  c10::intrusive_ptr<c10d::Store> store;
  c10::Device device = c10::Device(c10::kCPU);
  std::string name;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;
  // The last handle closes the backend in order (NCCL otherwise warns about leaked communicators).
  ~Impl() {
    if (backend) {
      try {
        backend->shutdown();
      } catch (...) {  // NOLINT(bugprone-empty-catch): closing is best effort at teardown
      }
    }
  }
};

const ProcessGroup::Impl& ProcessGroup::impl() const {
  if (!impl_) {
    throw std::logic_error("d9d::ProcessGroup: used before being set (default-constructed handle)");
  }
  return *impl_;
}

int ProcessGroup::size() const { return impl_ ? static_cast<int>(impl_->ranks.size()) : 0; }
int ProcessGroup::rank() const { return impl().rank; }
const std::vector<int>& ProcessGroup::ranks() const { return impl().ranks; }
c10::Device ProcessGroup::device() const { return impl().device; }
c10d::Backend* ProcessGroup::backend() const { return impl().backend.get(); }
c10d::Store* ProcessGroup::store() const { return impl().store.get(); }
const std::string& ProcessGroup::name() const { return impl().name; }

void ProcessGroup::barrier() const {
  if (size() <= 1) {
    return;
  }
  c10d::BarrierOptions options;
  if (device().is_cuda()) {
    options.device_ids = {device().index()};
  }
  impl().backend->barrier(options)->wait();
}

// ------------------------------------------------------------------------------------------------
// Launch environment

namespace {

int parse_int(std::string_view name, const std::string& value) {
  int out = 0;
  const auto* end =
      value.data() + value.size();  // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
  const auto [ptr, error] = std::from_chars(value.data(), end, out);
  if (error != std::errc() || ptr != end) {
    throw std::invalid_argument("d9d: environment variable " + std::string(name) + "=\"" + value +
                                "\" is not an integer");
  }
  return out;
}

// SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE look like "4", "4(x2)" or "4(x2),3": the first
// count.
int leading_count(std::string_view name, const std::string& value) {
  const auto digits = value.find_first_not_of("0123456789");
  return parse_int(name, value.substr(0, digits));
}

// The launch environment, read through the caller's getenv.
class LaunchEnv {
 public:
  explicit LaunchEnv(std::function<std::optional<std::string>(std::string_view)> getenv)
      : getenv_(std::move(getenv)) {}

  // Set and not empty.
  [[nodiscard]] std::optional<std::string> get(std::string_view name) const {
    auto value = getenv_(name);
    return value && !value->empty() ? value : std::nullopt;
  }
  [[nodiscard]] bool has(std::string_view name) const { return getenv_(name).has_value(); }
  [[nodiscard]] std::string required(std::string_view name) const {
    auto value = get(name);
    if (!value) {
      throw std::invalid_argument("d9d: environment variable " + std::string(name) +
                                  " is required by this launcher but not set");
    }
    return *value;
  }
  [[nodiscard]] int required_int(std::string_view name) const {
    return parse_int(name, required(name));
  }
  [[nodiscard]] int optional_int(std::string_view name, int fallback) const {
    auto value = get(name);
    return value ? parse_int(name, *value) : fallback;
  }

 private:
  std::function<std::optional<std::string>(std::string_view)> getenv_;
};

LaunchInfo torchrun_launch(const LaunchEnv& env) {
  LaunchInfo info;
  info.launcher = Launcher::torchrun;
  info.rank = env.required_int("RANK");
  info.world_size = env.required_int("WORLD_SIZE");
  info.local_rank = env.optional_int("LOCAL_RANK", info.rank);
  info.local_world_size = env.optional_int("LOCAL_WORLD_SIZE", info.world_size);
  if (info.world_size > 1) {
    info.master_addr = env.required("MASTER_ADDR");
    info.master_port = env.required_int("MASTER_PORT");
  }
  const auto agent = env.get("TORCHELASTIC_USE_AGENT_STORE");
  info.agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  info.restart_count = env.optional_int("TORCHELASTIC_RESTART_COUNT", 0);
  return info;
}

LaunchInfo slurm_launch(const LaunchEnv& env) {
  LaunchInfo info;
  info.launcher = Launcher::slurm;
  info.rank = env.required_int("SLURM_PROCID");
  info.world_size = env.required_int("SLURM_NTASKS");
  info.local_rank = env.optional_int("SLURM_LOCALID", 0);
  if (auto per_node = env.get("SLURM_NTASKS_PER_NODE")) {
    info.local_world_size = leading_count("SLURM_NTASKS_PER_NODE", *per_node);
  } else if (auto tasks = env.get("SLURM_TASKS_PER_NODE")) {
    info.local_world_size = leading_count("SLURM_TASKS_PER_NODE", *tasks);
  } else {
    info.local_world_size = info.world_size;
  }
  if (info.world_size > 1) {
    if (auto addr = env.get("MASTER_ADDR")) {
      info.master_addr = *addr;
    } else if (auto launch = env.get("SLURM_LAUNCH_NODE_IPADDR")) {
      info.master_addr = *launch;
    } else {
      throw std::invalid_argument(
          "d9d: under Slurm, set MASTER_ADDR to the first node, e.g. "
          "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)");
    }
    const int job = env.optional_int("SLURM_JOB_ID", 0);
    info.master_port = env.optional_int("MASTER_PORT", 10000 + job % 50000);
  }
  return info;
}

// Rank, world and port within their ranges.
void check_launch(const LaunchInfo& info) {
  const auto fail = [](const std::string& message) {
    throw std::invalid_argument("d9d: " + message);
  };
  if (info.world_size < 1) {
    fail("world size " + std::to_string(info.world_size) + " must be >= 1");
  }
  if (info.rank < 0 || info.rank >= info.world_size) {
    fail("rank " + std::to_string(info.rank) + " is outside the world of " +
         std::to_string(info.world_size) + " ranks");
  }
  if (info.local_world_size < 1 || info.local_world_size > info.world_size) {
    fail("local world size " + std::to_string(info.local_world_size) + " must be in [1, " +
         std::to_string(info.world_size) + "]");
  }
  if (info.local_rank < 0 || info.local_rank >= info.local_world_size) {
    fail("local rank " + std::to_string(info.local_rank) + " is outside the local world of " +
         std::to_string(info.local_world_size));
  }
  if (info.world_size > 1 && (info.master_port <= 0 || info.master_port > 65535)) {
    fail("MASTER_PORT " + std::to_string(info.master_port) + " is not a TCP port");
  }
}

}  // namespace

LaunchInfo parse_launch_env(
    const std::function<std::optional<std::string>(std::string_view)>& getenv) {
  const LaunchEnv env(getenv);
  LaunchInfo info;
  if (env.has("RANK") && env.has("WORLD_SIZE")) {
    info = torchrun_launch(env);
  } else if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {
    info = slurm_launch(env);
  } else {
    info.launcher = Launcher::local;
  }
  check_launch(info);
  return info;
}

// ------------------------------------------------------------------------------------------------
// Logger

struct Logger::State {
  int rank = 0;
  int world_size = 1;
  mutable std::mutex mutex;
  std::string coordinates;
};

std::string Logger::prefix() const {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  std::string out =
      "[d9d rank " + std::to_string(state_->rank) + "/" + std::to_string(state_->world_size);
  if (!state_->coordinates.empty()) {
    out += " | " + state_->coordinates;
  }
  return out + "]";
}

void Logger::set_coordinates(std::string coordinates) const {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  state_->coordinates = std::move(coordinates);
}

namespace {
void write_line(const std::string& prefix, std::string_view level, std::string_view message) {
  std::string line = prefix;
  line += level;
  line += message;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write per line: ranks do not interleave
  std::fflush(stderr);
}
}  // namespace

void Logger::info(std::string_view message) const { write_line(prefix(), " ", message); }
void Logger::warning(std::string_view message) const {
  write_line(prefix(), " warning: ", message);
}
void Logger::error(std::string_view message) const { write_line(prefix(), " error: ", message); }
void Logger::info_main(std::string_view message) const {
  if (state_->rank == 0) {
    info(message);
  }
}

// ------------------------------------------------------------------------------------------------
// DistributedContext

struct DistributedContext::Impl {
  LaunchInfo launch;
  ContextOptions options;
  c10::Device device = c10::Device(c10::kCPU);
  std::string backend_name = "none";
  std::string prefix;                     // this context's key namespace
  c10::intrusive_ptr<c10d::Store> store;  // the job's store under `prefix`
  std::unique_ptr<detail::Watchdog> watchdog;
  ProcessGroup world;
  Logger logger{std::make_shared<Logger::State>()};
  mutable std::mutex groups_mutex;
  mutable std::map<std::vector<int>, ProcessGroup> groups;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;
  // The watchdog goes first, while the groups still hold their connections: a context destroyed
  // by an exception reports it before its peers see the connections close.
  ~Impl() {
    if (watchdog) {
      watchdog->close(/*by_exception=*/std::uncaught_exceptions() > 0);
    }
  }
};

namespace {

c10::Device pick_device(const LaunchInfo& launch, const ContextOptions& options) {
  std::string wanted = options.device.value_or("");
  if (wanted.empty()) {
#ifdef D9D_WITH_CUDA
    wanted = torch::cuda::is_available() ? "cuda" : "cpu";
#else
    wanted = "cpu";
#endif
  }
  if (wanted == "cuda") {
    return {c10::kCUDA, static_cast<c10::DeviceIndex>(launch.local_rank)};
  }
  return c10::Device(wanted);
}

// "d9d/[attempt<n>/]<name or ctx<k>-of-<world>>/": k counts the unnamed contexts of a world > 1
// this process created, the same on every rank when every rank creates them in the same order.
std::string context_prefix(const LaunchInfo& launch, const ContextOptions& options) {
  static std::atomic<int> unnamed{0};
  std::string prefix = "d9d/";
  if (launch.restart_count > 0) {
    prefix += "attempt" + std::to_string(launch.restart_count) + "/";
  }
  if (!options.name.empty()) {
    return prefix + options.name + "/";
  }
  return prefix + "ctx" + std::to_string(unnamed++) + "-of-" + std::to_string(launch.world_size) +
         "/";
}

ProcessGroup make_group(const DistributedContext::Impl& impl, const std::vector<int>& ranks,
                        std::string name) {
  auto group = std::make_shared<ProcessGroup::Impl>();
  group->ranks = ranks;
  group->rank =
      static_cast<int>(std::find(ranks.begin(), ranks.end(), impl.launch.rank) - ranks.begin());
  group->device = impl.device;
  group->name = std::move(name);
  if (ranks.size() > 1) {
    std::string key = "group/";
    for (const int r : ranks) {
      key += std::to_string(r) + ",";
    }
    auto store = c10::make_intrusive<c10d::PrefixStore>(key, impl.store);
    group->store = store;
    const int size = static_cast<int>(ranks.size());
    if (impl.backend_name == "gloo") {
      auto options = c10d::ProcessGroupGloo::Options::create(impl.options.init_timeout);
      const auto& addr = impl.launch.master_addr;
      if (const char* ifname =
              std::getenv("GLOO_SOCKET_IFNAME")) {  // NOLINT(concurrency-mt-unsafe)
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (addr == "127.0.0.1" || addr == "localhost") {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, group->rank, size, options);
      backend->setTimeout(impl.options.step_timeout);
      group->backend = backend;
    } else {
#ifdef D9D_WITH_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = impl.options.step_timeout;
      group->backend =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group->rank, size, options);
#else
      throw std::runtime_error("d9d: backend " + impl.backend_name + " is not in this build");
#endif
    }
  }
  return ProcessGroup(std::move(group));
}

// A write to a peer that has died raises SIGPIPE, whose default action ends this process at once,
// before the watchdog can name the rank that died (Python, the usual host of torch's process
// groups, ignores SIGPIPE at start-up; a C++ program does not). A handler the program installed
// is kept; with SIGPIPE ignored the write fails with EPIPE and the watchdog's verdict follows.
void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    (void)std::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

DistributedContext DistributedContext::from_env(const ContextOptions& options) {
  return from_launch(parse_launch_env([](std::string_view name) -> std::optional<std::string> {
                       const char* value = std::getenv(std::string(name).c_str());  // NOLINT
                       return value ? std::optional<std::string>(value) : std::nullopt;
                     }),
                     options);
}

DistributedContext DistributedContext::local(const ContextOptions& options) {
  return from_launch(LaunchInfo{}, options);
}

DistributedContext DistributedContext::from_launch(const LaunchInfo& launch,
                                                   const ContextOptions& options) {
  auto impl = std::make_shared<Impl>();
  impl->launch = launch;
  impl->options = options;
  impl->device = pick_device(launch, options);
  auto log_state = std::make_shared<Logger::State>();
  log_state->rank = launch.rank;
  log_state->world_size = launch.world_size;
  impl->logger = Logger(std::move(log_state));
  if (impl->device.is_cuda()) {
#ifdef D9D_WITH_CUDA
    if (impl->device.index() >= static_cast<int>(torch::cuda::device_count())) {
      throw std::invalid_argument("d9d: device " + impl->device.str() + " does not exist (" +
                                  std::to_string(torch::cuda::device_count()) +
                                  " CUDA devices visible); set ContextOptions::device to \"cpu\" "
                                  "or start at most one rank per GPU");
    }
    c10::cuda::set_device(impl->device.index());
#else
    throw std::invalid_argument("d9d: device " + impl->device.str() +
                                " requested, but this build has no CUDA");
#endif
  }
  if (launch.world_size > 1) {
    ignore_broken_pipes();
    impl->backend_name = impl->device.is_cuda() ? "nccl" : "gloo";
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(launch.master_port);
    store_options.isServer = launch.rank == 0 && !launch.agent_store;
    store_options.waitWorkers = false;
    store_options.timeout = options.init_timeout;
    // A second context on rank 0 shares the server the first one started on this port.
    store_options.multiTenant = true;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(launch.master_addr, store_options);
    impl->prefix = context_prefix(launch, options);
    impl->store = c10::make_intrusive<c10d::PrefixStore>(impl->prefix, tcp);
    if (options.failure_timeout.count() > 0) {
      impl->watchdog = std::make_unique<detail::Watchdog>(
          tcp, detail::WatchdogOptions{
                   .rank = launch.rank,
                   .world = launch.world_size,
                   .prefix = impl->prefix,
                   .timeout = options.failure_timeout,
                   .rank0_serves_store = !launch.agent_store,
                   .store_address = launch.master_addr + ":" + std::to_string(launch.master_port),
                   .log_error = [logger = impl->logger](const std::string& line) {
                     logger.error(line);
                   }});
    }
  }
  std::vector<int> all(static_cast<std::size_t>(launch.world_size));
  for (int r = 0; r < launch.world_size; ++r) {
    all[static_cast<std::size_t>(r)] = r;
  }
  impl->world = make_group(*impl, all, "world");
  impl->groups.emplace(all, impl->world);
  // Every rank leaves only after all finished connecting: a rank that fails right after start-up
  // (a bad mesh, say) must not close connections others are still setting up.
  impl->world.barrier();
  return DistributedContext(std::move(impl));
}

int DistributedContext::rank() const { return impl_->launch.rank; }
int DistributedContext::world_size() const { return impl_->launch.world_size; }
int DistributedContext::local_rank() const { return impl_->launch.local_rank; }
int DistributedContext::local_world_size() const { return impl_->launch.local_world_size; }
Launcher DistributedContext::launcher() const { return impl_->launch.launcher; }
c10::Device DistributedContext::device() const { return impl_->device; }
std::string DistributedContext::backend_name() const { return impl_->backend_name; }
std::chrono::milliseconds DistributedContext::init_timeout() const {
  return impl_->options.init_timeout;
}
std::chrono::milliseconds DistributedContext::step_timeout() const {
  return impl_->options.step_timeout;
}
std::chrono::milliseconds DistributedContext::failure_timeout() const {
  return impl_->watchdog ? impl_->watchdog->timeout() : impl_->options.failure_timeout;
}
void DistributedContext::set_failure_timeout(std::chrono::milliseconds timeout) const {
  if (timeout.count() <= 0) {
    throw std::invalid_argument("d9d: a failure timeout must be > 0 (got " +
                                std::to_string(timeout.count()) + " ms)");
  }
  if (impl_->watchdog) {
    impl_->watchdog->set_timeout(timeout);
  }
}
const std::string& DistributedContext::store_prefix() const { return impl_->prefix; }

std::string DistributedContext::report_failure(std::string_view message) const {
  if (!impl_->watchdog) {
    return "";
  }
  return impl_->watchdog->report(message);
}

void DistributedContext::note_failure(std::string_view message) const {
  if (impl_->watchdog) {
    impl_->watchdog->note(message);
  }
}
const ProcessGroup& DistributedContext::world() const { return impl_->world; }
const Logger& DistributedContext::logger() const { return impl_->logger; }
void DistributedContext::barrier() const { impl_->world.barrier(); }

ProcessGroup DistributedContext::group(const std::vector<int>& ranks, std::string name) const {
  if (ranks.empty() || !std::is_sorted(ranks.begin(), ranks.end()) ||
      std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end()) {
    throw std::invalid_argument("d9d: a group's ranks must be sorted and unique");
  }
  if (ranks.front() < 0 || ranks.back() >= world_size()) {
    throw std::invalid_argument("d9d: a group's ranks must be in [0, " +
                                std::to_string(world_size()) + ")");
  }
  if (!std::binary_search(ranks.begin(), ranks.end(), rank())) {
    throw std::invalid_argument("d9d: rank " + std::to_string(rank()) +
                                " asked for a group it is not a member of");
  }
  const std::lock_guard<std::mutex> lock(impl_->groups_mutex);
  if (auto found = impl_->groups.find(ranks); found != impl_->groups.end()) {
    return found->second;
  }
  auto group = make_group(*impl_, ranks, name.empty() ? "group" : std::move(name));
  impl_->groups.emplace(ranks, group);
  return group;
}

}  // namespace d9d
