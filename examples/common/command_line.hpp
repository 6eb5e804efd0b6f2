// examples/common/command_line.hpp — the replacements the examples' (and bench/'s) command lines
// make in a trainer configuration file, applied before the file is validated (so a key given
// twice in the file is still an error).
//
//   auto overrides = command_line::run_overrides(o.data, o.output, o.steps);
//   command_line::measuring(overrides);  // a benchmark: no export, no progress bars
//   const auto cfg = d9d::TrainerConfig::from_file(o.config_path, overrides);
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include <d9d/train/config.hpp>

namespace command_line {

/// The run's token file (data.paths), output directory (run.output_dir) and optimizer steps
/// (run.total_steps); an empty string or a step count below 1 keeps the file's value.
inline d9d::TrainerConfig::Overrides run_overrides(const std::string& data,
                                                   const std::string& output, int64_t steps) {
  d9d::TrainerConfig::Overrides overrides;
  if (!data.empty()) {
    overrides.emplace_back("data.paths", nlohmann::json::array({data}).dump());
  }
  if (!output.empty()) {
    overrides.emplace_back("run.output_dir", nlohmann::json(output).dump());
  }
  if (steps > 0) {
    overrides.emplace_back("run.total_steps", std::to_string(steps));
  }
  return overrides;
}

/// Measuring, not producing a model: no export, no progress bars between a benchmark's rows.
inline void measuring(d9d::TrainerConfig::Overrides& overrides) {
  overrides.emplace_back("export.enabled", "false");
  overrides.emplace_back("logging.progress", "false");
}

}  // namespace command_line
