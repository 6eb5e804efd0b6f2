// d9d::bench::compare's non-template parts (d9d/advise/compare.hpp): the measurement of a run, the
// rows' maxima over the world, the table and its JSON.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <d9d/advise/compare.hpp>
#include <d9d/core/collectives.hpp>
#include <d9d/util/files.hpp>

namespace d9d::bench {

namespace {

// "12.60 GiB", or "49.05 MiB" below one GiB.
std::string memory(int64_t bytes) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const auto value = static_cast<double>(bytes);
  char text[32];
  if (value >= 1024.0 * kMiB) {
    std::snprintf(text, sizeof(text), "%.2f GiB", value / (1024.0 * kMiB));
  } else {
    std::snprintf(text, sizeof(text), "%.2f MiB", value / kMiB);
  }
  return text;
}

// 123,456 (thousands separated).
std::string grouped(double value) {
  const auto digits = std::to_string(static_cast<int64_t>(value + 0.5));
  std::string out;
  out.reserve(digits.size() + digits.size() / 3);
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) {
      out.push_back(',');
    }
    out.push_back(digits[i]);
  }
  return out;
}

std::string fixed(double value, const char* format) {
  char text[32];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

// The most any rank has, over the world (collective when the world has more than one rank).
int64_t world_max(const DistributedContext& ctx, int64_t value) {
  if (ctx.world_size() <= 1) {
    return value;
  }
  const auto& world = ctx.world();
  const auto t = at::tensor({static_cast<double>(value)}, at::kDouble).to(world.device());
  return static_cast<int64_t>(all_reduce(world, t, ReduceOp::max).cpu().item<double>());
}

bool valid_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         std::all_of(name.begin(), name.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '_' || c == '.';
         });
}

}  // namespace

namespace detail {

void PlanMeasure::step_end(const events::StepEnd& e) {
  if (steps_ == 0) {
    first_loss_ = e.loss;
  }
  last_loss_ = e.loss;
  if (steps_ >= warmup_steps_) {
    ++timed_steps_;
    timed_tokens_ += static_cast<double>(e.tokens);
    timed_seconds_ += e.seconds;
  }
  ++steps_;
}

void PlanMeasure::gradients(::d9d::detail::TrainerCore& core) {
  int64_t bytes = 0;
  for (const auto& record : core.parallel().parameters()) {
    const auto& g = record.local.grad();
    bytes += g.defined() ? static_cast<int64_t>(g.nbytes()) : 0;
  }
  gradient_bytes_ = std::max(gradient_bytes_, bytes);
}

int64_t frozen_parameter_bytes(::d9d::detail::TrainerCore& core) {
  int64_t bytes = 0;
  for (const auto& module : core.parallel().modules()) {
    for (const auto& item : module->named_parameters()) {
      bytes += item.value().requires_grad() ? 0 : static_cast<int64_t>(item.value().nbytes());
    }
  }
  return bytes;
}

advise::StateBytes held_state(::d9d::detail::TrainerCore& core, int64_t gradient_bytes) {
  advise::StateBytes held;
  held.gradients = gradient_bytes;
  held.parameters = frozen_parameter_bytes(core);
  for (const auto& record : core.parallel().parameters()) {
    held.parameters += static_cast<int64_t>(record.local.nbytes());
  }
  for (const auto& [key, state] : core.optimizer().state()) {
    const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get());
    if (adamw != nullptr) {
      held.optimizer +=
          static_cast<int64_t>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
      if (adamw->max_exp_avg_sq().defined()) {
        held.optimizer += static_cast<int64_t>(adamw->max_exp_avg_sq().nbytes());
      }
    }
  }
  return held;
}

PlanRow finish_row(const DistributedContext& ctx, std::string name, const PlanMeasure& measure,
                   const TrainResult& result, int64_t host_peak, const advise::StateBytes& held,
                   const std::optional<advise::StateBytes>& predicted, std::string not_predicted,
                   const CompareOptions& options) {
  PlanRow row;
  row.name = std::move(name);
  row.timed_steps = measure.timed_steps();
  // Every rank has the same steps' wall time and global token count (events::StepEnd).
  row.tokens_per_second =
      measure.timed_seconds() > 0 ? measure.timed_tokens() / measure.timed_seconds() : 0.0;
  if (options.flops_per_token > 0 && options.peak_tflops > 0) {
    row.mfu = row.tokens_per_second * options.flops_per_token /
              (static_cast<double>(ctx.world_size()) * options.peak_tflops * 1e12);
  }
  // The device allocator's peak is already the world's maximum; the host's is this rank's.
  row.peak_memory_bytes =
      ctx.device().is_cpu() ? world_max(ctx, host_peak) : result.peak_memory_bytes;
  row.state_bytes = world_max(ctx, held.total());
  // Every rank predicts or none does (the same Plan and config everywhere).
  if (predicted) {
    row.predicted_state_bytes = world_max(ctx, predicted->total());
  }
  row.not_predicted = std::move(not_predicted);
  row.first_loss = measure.first_loss();
  row.last_loss = measure.last_loss();
  row.host_issue_ms = result.issue_seconds_per_step * 1e3;
  return row;
}

std::vector<std::string> checked_names(const CompareOptions& options, std::size_t plans,
                                       const TrainerConfig& config) {
  if (options.warmup_steps < 0 || options.warmup_steps >= config.run.total_steps) {
    throw std::invalid_argument(
        "d9d::bench::compare: warmup_steps " + std::to_string(options.warmup_steps) +
        " leaves no timed step of run.total_steps " + std::to_string(config.run.total_steps) +
        ". Fix: run more steps than the warm-up");
  }
  std::vector<std::string> names = options.names;
  if (names.empty()) {
    for (std::size_t i = 1; i <= plans; ++i) {
      names.push_back("plan-" + std::to_string(i));
    }
  }
  if (names.size() != plans) {
    throw std::invalid_argument("d9d::bench::compare: " + std::to_string(names.size()) +
                                " names for " + std::to_string(plans) +
                                " Plans. Fix: give one name per Plan, in order, or none");
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!valid_name(names[i])) {
      throw std::invalid_argument("d9d::bench::compare: the name '" + names[i] +
                                  "' is also the Plan's output directory. Fix: use letters, "
                                  "digits, '-', '_' and '.' only");
    }
    if (std::count(names.begin(), names.end(), names[i]) > 1) {
      throw std::invalid_argument("d9d::bench::compare: the name '" + names[i] +
                                  "' is given twice. Fix: name each Plan once");
    }
  }
  for (const auto& name : options.only) {
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      throw std::invalid_argument("d9d::bench::compare: 'only' names '" + name +
                                  "', which is not one of the Plans' names. Fix: use the names "
                                  "given in 'names' (plan-1, plan-2, ... without them)");
    }
  }
  if (options.configure.size() > plans) {
    throw std::invalid_argument("d9d::bench::compare: " + std::to_string(options.configure.size()) +
                                " configure functions for " + std::to_string(plans) +
                                " Plans. Fix: give at most one per Plan, in order");
  }
  return names;
}

void refuse_profile_on_cpu(const TrainerConfig& config, const std::string& name) {
  if (config.profile.start >= 0) {
    throw std::invalid_argument(
        "d9d::bench::compare: Plan '" + name + "' traces steps (profile.start " +
        std::to_string(config.profile.start) +
        ") on the CPU, where compare measures the host memory through the profiler's hook. Fix: "
        "trace on a GPU, or leave the profile section out of the config compare gets");
  }
}

bool selected(const CompareOptions& options, const std::string& name) {
  return options.only.empty() ||
         std::find(options.only.begin(), options.only.end(), name) != options.only.end();
}

TrainerConfig plan_config(const TrainerConfig& config, const std::string& name,
                          const CompareOptions& options, std::size_t index) {
  auto out = config;
  if (!config.run.output_dir.empty()) {
    out.run.output_dir = files::join(config.run.output_dir, name);
    // The folders the config derived from the shared output_dir (TrainerConfig's defaults) follow
    // the Plan's own: otherwise every Plan traced into one profile/ and checkpointed into one
    // checkpoints/ (the last trace overwrote the others; a Plan could resume another's state).
    if (config.profile.dir == config.run.output_dir + "/profile") {
      out.profile.dir = out.run.output_dir + "/profile";
    }
    if (config.checkpoint.dir == files::join(config.run.output_dir, "checkpoints")) {
      out.checkpoint.dir = files::join(out.run.output_dir, "checkpoints");
    }
  }
  if (index < options.configure.size() && options.configure[index]) {
    options.configure[index](out);
  }
  return out;
}

void finish(const DistributedContext& ctx, Comparison& comparison, const CompareOptions& options) {
  const double first = comparison.rows.front().tokens_per_second;
  for (auto& row : comparison.rows) {
    row.ratio = first > 0 ? row.tokens_per_second / first : 0.0;
  }
  if (!ctx.is_main_process()) {
    return;
  }
  if (options.print) {
    std::fputs(comparison.table().c_str(), stdout);
    std::fflush(stdout);
  }
  if (!options.json_path.empty()) {
    files::create_directories(files::parent(options.json_path), "d9d::bench::compare");
    std::ofstream out(options.json_path);
    out << comparison.json() << "\n";
    if (!out) {
      throw std::runtime_error("d9d::bench::compare: cannot write " + options.json_path +
                               ". Fix: pass a path on a writable file system");
    }
  }
}

}  // namespace detail

std::string Comparison::table() const {
  const std::vector<std::string> header{"plan",           "tokens/s",   "tokens/s predicted",
                                        "x first",        "MFU",        "peak memory",
                                        "peak predicted", "state held", "state predicted"};
  std::vector<std::vector<std::string>> cells{header};
  for (const auto& row : rows) {
    cells.push_back(
        {row.name, grouped(row.tokens_per_second),
         row.predicted_tokens_per_second ? grouped(*row.predicted_tokens_per_second) : "-",
         fixed(row.ratio, "%.2f"), row.mfu ? fixed(100.0 * *row.mfu, "%.1f%%") : "-",
         row.peak_memory_bytes > 0 ? memory(row.peak_memory_bytes) : "-",
         row.predicted_peak_bytes ? memory(*row.predicted_peak_bytes) : "-",
         memory(row.state_bytes),
         row.predicted_state_bytes ? memory(*row.predicted_state_bytes) : "-"});
  }
  std::vector<std::size_t> widths(header.size(), 0);
  for (const auto& line : cells) {
    for (std::size_t c = 0; c < line.size(); ++c) {
      widths[c] = std::max(widths[c], line[c].size());
    }
  }
  std::ostringstream out;
  for (const auto& line : cells) {
    for (std::size_t c = 0; c < line.size(); ++c) {
      out << line[c];
      if (c + 1 < line.size()) {
        out << std::string(widths[c] - line[c].size() + 2, ' ');
      }
    }
    out << "\n";
  }
  for (const auto& row : rows) {
    if (!row.not_predicted.empty()) {
      out << row.name << ": not predicted: " << row.not_predicted << "\n";
    }
  }
  return out.str();
}

std::string Comparison::json() const {
  auto out = nlohmann::json::array();
  for (const auto& row : rows) {
    out.push_back({
        {"name", row.name},
        {"timed_steps", row.timed_steps},
        {"tokens_per_second", row.tokens_per_second},
        {"ratio", row.ratio},
        {"mfu", row.mfu ? nlohmann::json(*row.mfu) : nlohmann::json(nullptr)},
        {"peak_memory_bytes", row.peak_memory_bytes},
        {"state_bytes", row.state_bytes},
        {"predicted_state_bytes", row.predicted_state_bytes
                                      ? nlohmann::json(*row.predicted_state_bytes)
                                      : nlohmann::json(nullptr)},
        {"not_predicted", row.not_predicted},
        {"predicted_peak_bytes", row.predicted_peak_bytes
                                     ? nlohmann::json(*row.predicted_peak_bytes)
                                     : nlohmann::json(nullptr)},
        {"predicted_tokens_per_second", row.predicted_tokens_per_second
                                            ? nlohmann::json(*row.predicted_tokens_per_second)
                                            : nlohmann::json(nullptr)},
        {"first_loss", row.first_loss},
        {"last_loss", row.last_loss},
        {"host_issue_ms", row.host_issue_ms},
    });
  }
  return out.dump(1);
}

}  // namespace d9d::bench
