// d9d/util/progress.cpp — the console progress line: rendering, throttling, and the two drawing
// modes (d9d/util/progress.hpp).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <sys/ioctl.h>
#include <unistd.h>

#include <d9d/util/progress.hpp>

namespace d9d::util {

namespace {

constexpr std::string_view kWho = "d9d::util::ProgressBar";
constexpr std::string_view kGap = "  ";

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string fixed(double value, int decimals) {
  std::array<char, 64> text{};
  std::snprintf(text.data(), text.size(), "%.*f", decimals, value);
  return text.data();
}

bool is_terminal(std::FILE* out) {
  const int fd = fileno(out);
  if (fd < 0 || isatty(fd) == 0) {
    return false;
  }
  const char* term = std::getenv("TERM");
  return term == nullptr || std::string_view(term) != "dumb";
}

// Columns of the terminal behind `out`, or 0 when it is not one.
int terminal_columns(std::FILE* out) {
  const int fd = fileno(out);
  winsize size{};
  if (fd < 0 || ioctl(fd, TIOCGWINSZ, &size) != 0) {
    return 0;
  }
  return size.ws_col;
}

std::string counter(std::int64_t step, std::int64_t total) {
  if (total <= 0) {
    return std::to_string(step);
  }
  std::string done = std::to_string(step);
  const std::string all = std::to_string(total);
  if (done.size() < all.size()) {
    done.insert(0, all.size() - done.size(), ' ');
  }
  return done + "/" + all;
}

std::string bar(std::int64_t step, std::int64_t total, int width) {
  const double fraction =
      std::clamp(static_cast<double>(step) / static_cast<double>(total), 0.0, 1.0);
  const auto filled = static_cast<std::size_t>(fraction * width);
  const auto cells = static_cast<std::size_t>(width);
  std::string text = "[" + std::string(filled, '=');
  if (filled < cells) {
    text += '>';
    text.append(cells - filled - 1, ' ');
  }
  return text + "]";
}

}  // namespace

std::string format_si(double value) {
  if (std::isnan(value)) {
    return "nan";
  }
  if (std::isinf(value)) {
    return value > 0 ? "inf" : "-inf";
  }
  if (value == 0) {
    return "0";
  }
  const std::string sign = value < 0 ? "-" : "";
  double magnitude = std::abs(value);
  if (magnitude < 1.0) {
    // Three significant digits, trailing zeros kept: 0.500, 0.0123, 1.23e-05.
    std::array<char, 64> text{};
    std::snprintf(text.data(), text.size(), "%#.3g", magnitude);
    return sign + text.data();
  }
  constexpr std::array<std::string_view, 7> kPrefixes = {"", "k", "M", "G", "T", "P", "E"};
  std::size_t prefix = 0;
  // 999.5 would print as "1000": it belongs to the next prefix ("1.00k").
  while (magnitude >= 999.5 && prefix + 1 < kPrefixes.size()) {
    magnitude = std::max(magnitude / 1000.0, 1.0);
    ++prefix;
  }
  const int decimals = magnitude >= 99.95 ? 0 : magnitude >= 9.995 ? 1 : 2;
  return sign + fixed(magnitude, decimals) + std::string(kPrefixes[prefix]);
}

std::string format_duration(double seconds) {
  constexpr double kLongest = 1e12;  // past this, llround would overflow soon: not a real ETA
  if (!std::isfinite(seconds) || seconds < 0 || seconds > kLongest) {
    return "--:--";
  }
  const long long total = std::llround(seconds);
  const long long hours = total / 3600;
  const long long minutes = (total % 3600) / 60;
  const long long secs = total % 60;
  std::array<char, 64> text{};
  if (hours == 0) {
    std::snprintf(text.data(), text.size(), "%02lld:%02lld", minutes, secs);
  } else {
    std::snprintf(text.data(), text.size(), "%lld:%02lld:%02lld", hours, minutes, secs);
  }
  return text.data();
}

ProgressBar::ProgressBar(std::int64_t total, std::string label, ProgressOptions options)
    : total_(total), label_(std::move(label)), options_(std::move(options)) {
  if (total_ < 0) {
    throw std::invalid_argument(std::string(kWho) + ": total = " + std::to_string(total_) +
                                " is negative. Fix: the number of steps, or 0 when unknown");
  }
  if (options_.bar_width <= 0 || options_.max_width <= 0) {
    throw std::invalid_argument(
        std::string(kWho) + ": bar_width = " + std::to_string(options_.bar_width) +
        ", max_width = " + std::to_string(options_.max_width) + ". Fix: both must be >= 1");
  }
  if (options_.out == nullptr) {
    throw std::invalid_argument(std::string(kWho) + ": out = nullptr. Fix: stderr, or a stream");
  }
  if (!options_.clock) {
    options_.clock = steady_seconds;
  }
  interactive_ = options_.mode == ProgressMode::interactive ||
                 (options_.mode == ProgressMode::automatic && is_terminal(options_.out));
  width_ = options_.max_width;
  if (interactive_) {
    // One column short of the terminal: writing the last column wraps on some terminals.
    const int columns = terminal_columns(options_.out);
    if (columns > 1) {
      width_ = std::min(width_, columns - 1);
    }
  }
  start_ = now();
  step_ = options_.initial_step;
}

ProgressBar::~ProgressBar() {
  if (line_open_) {
    std::fputc('\n', options_.out);
    std::fflush(options_.out);
  }
}

double ProgressBar::now() const { return options_.clock(); }

void ProgressBar::update(std::int64_t step, const ProgressFields& fields) {
  if (finished_) {
    return;
  }
  const double time = now();
  step_ = step;
  fields_ = fields;
  shown_ = false;
  const bool last = total_ > 0 && step_ >= total_;
  const double interval = interactive_ ? options_.redraw_interval_s : options_.print_interval_s;
  if (last || !ever_shown_ || time - last_show_ >= interval) {
    show(time, last);
  }
}

void ProgressBar::finish() {
  if (finished_) {
    return;
  }
  finished_ = true;
  if (interactive_) {
    show(now(), true);
    std::fputc('\n', options_.out);
    std::fflush(options_.out);
    line_open_ = false;
  } else if (!(shown_ && shown_done_)) {
    show(now(), true);
  }
}

void ProgressBar::write(std::string_view line) {
  std::string text;
  if (line_open_) {
    text += '\r';
    text.append(drawn_length_, ' ');
    text += '\r';
  }
  text.append(line);
  text += '\n';
  std::fwrite(text.data(), 1, text.size(), options_.out);
  std::fflush(options_.out);
  if (line_open_) {
    drawn_length_ = 0;
    draw(last_line_);
  }
}

void ProgressBar::show(double time, bool done) {
  last_line_ = render(time, done);
  draw(last_line_);
  last_show_ = time;
  ever_shown_ = true;
  shown_ = true;
  shown_done_ = done;
}

void ProgressBar::draw(const std::string& line) {
  std::string text;
  if (interactive_) {
    text = "\r" + line;
    if (line.size() < drawn_length_) {
      text.append(drawn_length_ - line.size(), ' ');  // wipe the rest of a longer previous line
    }
    drawn_length_ = line.size();
    line_open_ = true;
  } else {
    text = line + "\n";
  }
  std::fwrite(text.data(), 1, text.size(), options_.out);
  std::fflush(options_.out);
}

std::string ProgressBar::render(double time, bool done) const {
  std::string head = label_;
  const auto append_head = [&head](const std::string& part) {
    if (!head.empty()) {
      head += ' ';
    }
    head += part;
  };
  if (total_ > 0) {
    append_head(bar(step_, total_, options_.bar_width));
  }
  append_head(counter(step_, total_));

  const double elapsed = time - start_;
  const auto steps = static_cast<double>(step_ - options_.initial_step);
  const bool rate_known = elapsed > 0 && steps > 0;
  const double rate = rate_known ? steps / elapsed : 0.0;
  std::string rate_text = "? it/s";
  if (rate_known) {
    rate_text = rate >= 1.0 ? format_si(rate) + " it/s" : format_si(1.0 / rate) + " s/it";
  }
  std::string time_text;
  if (done || (total_ > 0 && step_ >= total_)) {
    time_text = "took " + format_duration(elapsed);
  } else if (total_ > 0) {
    time_text = "ETA " + (rate_known ? format_duration(static_cast<double>(total_ - step_) / rate)
                                     : std::string("--:--"));
  } else {
    time_text = "elapsed " + format_duration(elapsed);
  }

  const auto compose = [&](std::size_t field_count) {
    std::string line = head;
    for (std::size_t i = 0; i < field_count; ++i) {
      line += std::string(kGap) + fields_[i].first + " " + fields_[i].second;
    }
    return line + std::string(kGap) + rate_text + std::string(kGap) + time_text;
  };
  std::size_t field_count = fields_.size();
  std::string line = compose(field_count);
  if (interactive_) {
    const auto width = static_cast<std::size_t>(width_);
    while (line.size() > width && field_count > 0) {
      line = compose(--field_count);
    }
    if (line.size() > width) {
      line.resize(width);
    }
  }
  return line;
}

}  // namespace d9d::util
