// d9d/track/tensorboard.hpp — scalars in TensorBoard's event-file format, without TensorFlow.
//
//   d9d::track::TensorBoardWriter tb("runs/exp1");   // runs/exp1/events.out.tfevents.<t>.<host>
//   tb.add_scalar("train/loss", loss, step);
//   tb.flush();                                       // also every 10 s and on destruction
//
// The file is a sequence of TFRecords (d9d/track/tfrecord.hpp), each holding one serialized
// tensorflow.Event: first {wall_time, file_version: "brain.Event:2"}, then one
// {wall_time, step, summary {value {tag, simple_value}...}} per add_scalar / add_scalars.
// simple_value is a float: doubles are rounded, and finite values beyond float's range become
// ±inf. Not thread-safe: write from one thread of one rank (usually the main rank).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <d9d/track/detail/file.hpp>

namespace d9d::track {

/// Knobs of a TensorBoardWriter; fill with designated initialisers.
struct TensorBoardOptions {
  /// Appended to the file name after a dot: events.out.tfevents.<t>.<host>.<suffix>.
  std::string filename_suffix = {};
  /// Buffered events reach the file once this many seconds passed since the last flush (checked
  /// on each add); 0 flushes after every event.
  double flush_interval_s = 10.0;
};

/// Appends scalar events to a new event file in a log directory.
class TensorBoardWriter {
 public:
  /// Creates `log_dir` (with parents) and the event file
  /// `events.out.tfevents.<unix seconds>.<hostname>[.<suffix>]`, then writes the file-version
  /// event. When that name is taken (two writers in one second), ".1", ".2", ... is appended.
  /// Throws std::runtime_error naming the path and the reason when either cannot be created.
  explicit TensorBoardWriter(const std::string& log_dir, const TensorBoardOptions& options = {});
  /// Flushes; a failure there is reported on stderr (a destructor does not throw).
  ~TensorBoardWriter();
  TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept = default;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// One event holding one value. `wall_time`: seconds since the Unix epoch (default: now).
  /// Throws std::invalid_argument for an empty tag, std::runtime_error when the write fails.
  void add_scalar(std::string_view tag, double value, std::int64_t step,
                  std::optional<double> wall_time = {});
  /// One event holding several values of the same step (e.g. {{"train/loss", 2.1}, {"lr", 1e-3}}).
  void add_scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                   std::optional<double> wall_time = {});
  /// Writes buffered events to the file.
  void flush();

  /// The event file.
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::string path_;
  detail::FilePtr file_;
  double flush_interval_s_ = 0;
  double last_flush_ = 0;
};

namespace detail {

/// Serialized tensorflow.Event {wall_time, file_version: "brain.Event:2"}.
[[nodiscard]] std::string encode_file_version_event(double wall_time);

/// Serialized tensorflow.Event {wall_time, step, summary {value {tag, simple_value}...}}.
[[nodiscard]] std::string encode_scalars_event(
    double wall_time, std::int64_t step,
    std::span<const std::pair<std::string_view, double>> scalars);

/// `value` as a float; finite values beyond float's range become ±inf (a plain cast is undefined).
[[nodiscard]] float to_float_saturating(double value);

}  // namespace detail

}  // namespace d9d::track
