// d9d/train/profiler.cpp — the trainer's profiling pass (d9d/train/detail/profiler.hpp).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <d9d/train/detail/profiler.hpp>
#include <d9d/util/files.hpp>

namespace d9d::detail {
namespace {

// The device allocator's statistics (CUDA and other caching allocators; CPU has none).
c10::DeviceIndex device_index(c10::Device device) {
  return device.has_index() ? device.index()
                            : c10::impl::getDeviceGuardImpl(device.type())->getDevice().index();
}

}  // namespace

void reset_peak_memory(c10::Device device) {
  if (!device.is_cpu()) {
    c10::getDeviceAllocator(device.type())->resetPeakStats(device_index(device));
  }
}

int64_t peak_memory(c10::Device device) {
  if (device.is_cpu()) {
    return 0;
  }
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device_index(device));
  return stats.allocated_bytes[0].peak;  // aggregate over pools
}

namespace {

// When the host launched device work (a kernel, or a whole CUDA graph), sorted.
std::vector<uint64_t> launch_times(
    const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  static const std::set<std::string> names = {
      "cudaLaunchKernel", "cudaLaunchKernelExC",         "cuLaunchKernel",
      "cuLaunchKernelEx", "cudaLaunchCooperativeKernel", "cudaGraphLaunch"};
  std::vector<uint64_t> out;
  for (const auto& event : events) {
    if (event.deviceType() == c10::kCPU && names.contains(event.name())) {
      out.push_back(event.startNs());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Per d9d phase (the RECORD_USER_SCOPE ranges "d9d::step", "d9d::forward", ...): how far the
// memory the profiler saw allocated on `device` rose above its level at the phase's start, at the
// most, over every occurrence of the phase; from the trace's allocation events ("[memory]", bytes
// allocated > 0 or freed < 0; CPU allocations too, so the summary is real on CPU runs). Also the
// phase's host time and the `launches` (launch_times) that start inside it.
nlohmann::json phase_memory(const std::vector<torch::autograd::profiler::KinetoEvent>& events,
                            c10::Device device, const std::vector<uint64_t>& launches) {
  struct Change {
    uint64_t at;
    int64_t bytes;
  };
  std::vector<Change> changes;
  for (const auto& event : events) {
    if (event.name() == "[memory]" && event.deviceType() == device.type()) {
      changes.push_back({event.startNs(), event.nBytes()});
    }
  }
  std::stable_sort(changes.begin(), changes.end(),
                   [](const Change& a, const Change& b) { return a.at < b.at; });
  std::vector<int64_t> live(changes.size() + 1, 0);  // live[i]: before change i
  for (std::size_t i = 0; i < changes.size(); ++i) {
    live[i + 1] = live[i] + changes[i].bytes;
  }
  std::map<std::string, std::pair<int64_t, int64_t>> phases;  // name -> (peak rise, occurrences)
  // Host time and kernel launches (CUDA runtime calls that start inside the phase, any thread).
  std::map<std::string, std::pair<uint64_t, int64_t>> costs;  // name -> (host ns, launches)
  for (const auto& event : events) {
    const auto name = event.name();
    if (name.rfind("d9d::", 0) != 0 || event.deviceType() != c10::kCPU) {
      continue;
    }
    auto& [host_ns, launched] = costs[name];
    host_ns += event.durationNs();
    launched += std::upper_bound(launches.begin(), launches.end(), event.endNs()) -
                std::lower_bound(launches.begin(), launches.end(), event.startNs());
    const auto first =
        std::lower_bound(changes.begin(), changes.end(), event.startNs(),
                         [](const Change& change, uint64_t at) { return change.at < at; });
    const auto begin = static_cast<std::size_t>(first - changes.begin());
    int64_t rise = 0;
    for (std::size_t i = begin; i < changes.size() && changes[i].at <= event.endNs(); ++i) {
      rise = std::max(rise, live[i + 1] - live[begin]);
    }
    auto& [peak, count] = phases[name];
    peak = std::max(peak, rise);
    ++count;
  }
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, value] : phases) {
    const auto& [host_ns, launched] = costs[name];
    out[name] = {{"peak_rise_bytes", value.first},
                 {"occurrences", value.second},
                 {"host_ms", static_cast<double>(host_ns) / 1e6},
                 {"launches", launched}};
  }
  return out;
}

// Device kernels in the trace (CUDA activity that is not a copy, a set or an annotation).
int64_t device_kernels(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  int64_t count = 0;
  for (const auto& event : events) {
    const auto name = event.name();
    if (event.deviceType() == c10::kCUDA && name != "[memory]" && name.rfind("Memcpy", 0) != 0 &&
        name.rfind("Memset", 0) != 0 && name.rfind("d9d::", 0) != 0) {
      ++count;
    }
  }
  return count;
}

}  // namespace

StepProfiler::StepProfiler(const ProfileConfig& config, const DistributedContext& context)
    : config_(config), context_(context) {}

StepProfiler::~StepProfiler() {
  if (active_) {
    (void)torch::autograd::profiler::disableProfiler();
  }
}

void StepProfiler::before(int64_t step) {
  if (config_.start < 0 || step != config_.start) {
    return;
  }
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
  if (context_.device().is_cuda()) {
    activities.insert(prof::ActivityType::CUDA);
  }
  const prof::ProfilerConfig settings(prof::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                      /*profile_memory=*/config_.operators);
  // Without operators, only the user scope is recorded: the d9d phase ranges (and c10d's
  // collective ranges, e.g. nccl:all_reduce), not every ATen operator and autograd node.
  std::unordered_set<at::RecordScope> scopes;
  if (!config_.operators) {
    scopes.insert(at::RecordScope::USER_SCOPE);
  }
  torch::autograd::profiler::prepareProfiler(settings, activities);
  torch::autograd::profiler::enableProfiler(settings, activities, scopes);
  reset_peak_memory(context_.device());
  active_ = true;
}

std::string StepProfiler::after(int64_t step) {
  if (!active_ || step + 1 < config_.start + config_.steps) {
    return "";
  }
  active_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  files::create_directories(config_.dir, "d9d profile");
  const auto rank = std::to_string(context_.rank());
  const auto path = files::join(config_.dir, "rank-" + rank + ".trace.json");
  result->save(path);
  const auto launches = launch_times(result->events());
  const nlohmann::json memory = {
      {"rank", context_.rank()},
      {"device", context_.device().str()},
      {"steps", {config_.start, config_.start + config_.steps}},
      // The caching allocator's peak over the traced steps (CUDA; 0 on CPU, which has none).
      {"peak_allocated_bytes", peak_memory(context_.device())},
      // Host launches of device work (kernels, graphs) and device kernels over the traced
      // steps: what CUDA graphs cut (0 on CPU).
      {"launches", launches.size()},
      {"device_kernels", device_kernels(result->events())},
      {"phases", phase_memory(result->events(), context_.device(), launches)}};
  std::FILE* out =
      std::fopen(files::join(config_.dir, "rank-" + rank + ".memory.json").c_str(), "w");
  if (out != nullptr) {
    const auto text = memory.dump(2) + "\n";
    std::fputs(text.c_str(), out);
    std::fclose(out);
  }
  return path;
}

}  // namespace d9d::detail
