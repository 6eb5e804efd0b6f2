// d9d/util/progress.hpp — a console progress line for the main rank of a loop (training,
// inference, a checkpoint's save and load).
//
//   d9d::util::ProgressBar bar(total_steps, "train");            // stderr; redraws when a TTY
//   bar.update(step, {{"loss", "2.134"}, {"lr", "3.0e-04"}});     // fields are preformatted
//   bar.finish();                                                 // final line + newline
//
// A line reads (tests/util/progress_test.cpp, Util_Progress_plain.ShowsRateAndEta):
//   train [==========>         ] 150/300  loss 2.134  lr 3.0e-04  4.52 it/s  ETA 00:33
// and ends in `took 01:06` once the last step is reached or finish() is called (`elapsed 01:06`
// while running for an unknown total); below one step a second the rate reads `3.20 s/it`. The
// rate is the mean since construction: steps past `initial_step` over the seconds elapsed on the
// clock. Interactive mode (a terminal) redraws one line with '\r', at most every
// redraw_interval_s, within max_width bytes (fields are dropped from the right to fit). Plain mode
// (CI logs, files) prints a full line on the first update, then at most every print_interval_s,
// and on the last step. Not thread-safe: drive it from the loop of the main rank. No LibTorch.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace d9d::util {

/// How a ProgressBar draws: `automatic` is `interactive` when the stream is a terminal (and TERM
/// is not "dumb"), else `plain`.
enum class ProgressMode { automatic, interactive, plain };

/// Knobs of a ProgressBar; fill with designated initialisers.
struct ProgressOptions {
  /// Where lines go (not owned).
  std::FILE* out = stderr;
  ProgressMode mode = ProgressMode::automatic;
  /// Plain mode: at most one line per this many seconds (first update and last step always print).
  double print_interval_s = 30.0;
  /// Interactive mode: at most one redraw per this many seconds (the last step always redraws).
  double redraw_interval_s = 0.1;
  /// Interactive mode: the longest line, in bytes (also kept below the terminal's width).
  int max_width = 120;
  /// Cells between the brackets.
  int bar_width = 20;
  /// Steps already done when the bar starts (a resumed run); the rate counts only later steps.
  std::int64_t initial_step = 0;
  /// Seconds on a monotonic clock; empty: std::chrono::steady_clock. Tests pass a fake one.
  std::function<double()> clock = {};
};

/// Formatted fields of one update, in display order: {{"loss", "2.134"}, {"tok/s", "12.3k"}}.
using ProgressFields = std::vector<std::pair<std::string, std::string>>;

/// The progress line of a loop of `total` steps (0: unknown total, no bar and no ETA).
class ProgressBar {
 public:
  /// Throws std::invalid_argument for a negative total or a non-positive bar_width / max_width.
  ProgressBar(std::int64_t total, std::string label, ProgressOptions options = {});
  /// Ends an open interactive line with a newline (without claiming the loop finished).
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ProgressBar(ProgressBar&&) = delete;
  ProgressBar& operator=(ProgressBar&&) = delete;

  /// `step` steps are done; shows the line when the mode's throttle allows. Ignored after finish().
  void update(std::int64_t step, const ProgressFields& fields = {});
  /// Prints the final line (unless plain mode printed this state already) and a newline. Once.
  void finish();
  /// Prints a log line without breaking the bar (interactive: clears it, prints, redraws it).
  void write(std::string_view line);

  /// Whether lines are redrawn in place.
  [[nodiscard]] bool interactive() const { return interactive_; }
  /// The line as last rendered (for logging it elsewhere); empty before the first update.
  [[nodiscard]] const std::string& last_line() const { return last_line_; }

 private:
  [[nodiscard]] double now() const;
  [[nodiscard]] std::string render(double time, bool done) const;
  void show(double time, bool done);
  void draw(const std::string& line);

  std::int64_t total_;
  std::string label_;
  ProgressOptions options_;
  bool interactive_ = false;
  int width_ = 0;
  double start_ = 0;
  std::int64_t step_ = 0;
  ProgressFields fields_;
  bool ever_shown_ = false;
  bool shown_ = false;       // the current state is on screen / in the log
  bool shown_done_ = false;  // ... rendered as finished ("took", not "ETA")
  bool line_open_ = false;   // interactive: the cursor sits at the end of a drawn line
  bool finished_ = false;
  double last_show_ = 0;
  std::string last_line_;
  std::size_t drawn_length_ = 0;
};

/// Three significant digits and an SI prefix: 12345 -> "12.3k", 2.5e6 -> "2.50M", 999 -> "999",
/// 0.5 -> "0.500"; negative values get a '-', NaN / ±inf read "nan" / "inf" / "-inf".
[[nodiscard]] std::string format_si(double value);

/// Whole seconds as "mm:ss" below an hour, else "h:mm:ss" (3725 -> "1:02:05"); "--:--" when
/// negative or not finite.
[[nodiscard]] std::string format_duration(double seconds);

}  // namespace d9d::util
