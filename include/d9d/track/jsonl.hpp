// d9d/track/jsonl.hpp — metrics as JSON lines: one object per step, appended and flushed per line.
//
//   d9d::track::JsonlWriter metrics("runs/exp1/metrics.jsonl");
//   metrics.write(step, {{"loss", 2.1}, {"lr", 1e-3}});
//   // {"step":3,"wall_time":1767225600.25,"loss":2.1,"lr":0.001}
//
// Keys: "step", "wall_time" (seconds since the Unix epoch), then the scalars in the given order.
// JSON has no NaN or infinity: such values are written as null, so every line stays valid JSON
// (read null as "not finite"). Numbers are written with enough digits to read back the same
// double. An existing file is appended to (a resumed run continues it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <d9d/track/detail/file.hpp>

namespace d9d::track {

/// Appends one JSON object per write() to a file.
class JsonlWriter {
 public:
  /// Creates the parent directories and opens `path` for appending. Throws std::runtime_error
  /// naming the path and the reason when either fails.
  explicit JsonlWriter(const std::string& path);
  JsonlWriter(JsonlWriter&&) noexcept = default;
  JsonlWriter& operator=(JsonlWriter&&) noexcept = default;
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  ~JsonlWriter() = default;

  /// Appends {"step": step, "wall_time": ..., <scalars in order>} and a newline, then flushes.
  /// `wall_time` defaults to now. Throws std::invalid_argument for a key named "step" or
  /// "wall_time" or given twice (nothing is written then), std::runtime_error when writing fails.
  void write(std::int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
             std::optional<double> wall_time = {});

  /// The file written to.
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
  detail::FilePtr file_;
};

}  // namespace d9d::track
