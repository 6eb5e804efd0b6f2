// TensorBoard event files: hand-encoded tensorflow.Event / Summary protobufs in TFRecords.
//
// Protobuf wire format used here: a field starts with the varint (field_number << 3 | wire_type);
// wire type 0 is a varint (int64 as its two's-complement uint64), 1 is 8 little-endian bytes
// (double), 2 is a varint length then bytes (string, nested message), 5 is 4 little-endian bytes
// (float). Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary). Summary: value = 1 (repeated Value). Value: tag = 1 (string),
// simple_value = 2 (float).
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include <d9d/track/tensorboard.hpp>
#include <d9d/track/tfrecord.hpp>
#include <d9d/util/files.hpp>

namespace d9d::track {

namespace {

constexpr std::string_view kWho = "d9d::track::TensorBoardWriter";
constexpr std::string_view kFileVersion = "brain.Event:2";

enum WireType : std::uint32_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void append_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80U) {
    out.push_back(static_cast<char>((value & 0x7FU) | 0x80U));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void append_key(std::string& out, std::uint32_t field, WireType type) {
  append_varint(out, (field << 3) | type);
}

void append_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFU));
  }
}

void append_double(std::string& out, std::uint32_t field, double value) {
  append_key(out, field, fixed64);
  append_le(out, std::bit_cast<std::uint64_t>(value), 8);
}

void append_float(std::string& out, std::uint32_t field, float value) {
  append_key(out, field, fixed32);
  append_le(out, std::bit_cast<std::uint32_t>(value), 4);
}

void append_int64(std::string& out, std::uint32_t field, std::int64_t value) {
  append_key(out, field, varint);
  append_varint(out, static_cast<std::uint64_t>(value));
}

void append_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  append_key(out, field, length_delimited);
  append_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields.
constexpr std::uint32_t kEventWallTime = 1;
constexpr std::uint32_t kEventStep = 2;
constexpr std::uint32_t kEventFileVersion = 3;
constexpr std::uint32_t kEventSummary = 5;
// Summary / Summary.Value fields.
constexpr std::uint32_t kSummaryValue = 1;
constexpr std::uint32_t kValueTag = 1;
constexpr std::uint32_t kValueSimpleValue = 2;

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

namespace detail {

float to_float_saturating(double value) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (std::isnan(value)) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (value > kMax) {
    return std::numeric_limits<float>::infinity();
  }
  if (value < -kMax) {
    return -std::numeric_limits<float>::infinity();
  }
  return static_cast<float>(value);
}

std::string encode_file_version_event(double wall_time) {
  std::string event;
  append_double(event, kEventWallTime, wall_time);
  append_bytes(event, kEventFileVersion, kFileVersion);
  return event;
}

std::string encode_scalars_event(double wall_time, std::int64_t step,
                                 std::span<const std::pair<std::string_view, double>> scalars) {
  std::string summary;
  std::string value;
  for (const auto& [tag, number] : scalars) {
    value.clear();
    append_bytes(value, kValueTag, tag);
    append_float(value, kValueSimpleValue, to_float_saturating(number));
    append_bytes(summary, kSummaryValue, value);
  }
  std::string event;
  append_double(event, kEventWallTime, wall_time);
  append_int64(event, kEventStep, step);
  append_bytes(event, kEventSummary, summary);
  return event;
}

}  // namespace detail

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir, const TensorBoardOptions& options)
    : flush_interval_s_(options.flush_interval_s) {
  d9d::files::create_directories(log_dir, kWho);
  const double created = detail::unix_time_now();
  std::string name = "events.out.tfevents." +
                     std::to_string(static_cast<std::int64_t>(std::floor(created))) + "." +
                     d9d::files::hostname();
  if (!options.filename_suffix.empty()) {
    name += "." + options.filename_suffix;
  }
  constexpr int kMaxAttempts = 1000;
  for (int attempt = 0; attempt < kMaxAttempts && !file_; ++attempt) {
    path_ = d9d::files::join(log_dir, attempt == 0 ? name : name + "." + std::to_string(attempt));
    file_ = detail::create_new_file(path_, kWho);
  }
  if (!file_) {
    throw std::runtime_error(std::string(kWho) + ": cannot create '" +
                             d9d::files::join(log_dir, name) +
                             "': " + std::to_string(kMaxAttempts) +
                             " files of that name exist. Fix: pass a filename_suffix");
  }
  write_event(detail::encode_file_version_event(created));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ && std::fflush(file_.get()) != 0) {
    std::fprintf(stderr, "%s: flushing '%s' failed; the last events may be lost\n", kWho.data(),
                 path_.c_str());
  }
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, std::int64_t step,
                                   std::optional<double> wall_time) {
  if (tag.empty()) {
    throw std::invalid_argument(
        std::string(kWho) + "::add_scalar: empty tag. Fix: name the value, e.g. \"train/loss\"");
  }
  const std::array<std::pair<std::string_view, double>, 1> scalars{{{tag, value}}};
  write_event(
      detail::encode_scalars_event(wall_time.value_or(detail::unix_time_now()), step, scalars));
}

void TensorBoardWriter::add_scalars(std::int64_t step,
                                    const std::vector<std::pair<std::string, double>>& scalars,
                                    std::optional<double> wall_time) {
  std::vector<std::pair<std::string_view, double>> views;
  views.reserve(scalars.size());
  for (const auto& [tag, value] : scalars) {
    if (tag.empty()) {
      throw std::invalid_argument(std::string(kWho) +
                                  "::add_scalars: empty tag. Fix: name every value, e.g. \"lr\"");
    }
    views.emplace_back(tag, value);
  }
  write_event(
      detail::encode_scalars_event(wall_time.value_or(detail::unix_time_now()), step, views));
}

void TensorBoardWriter::flush() {
  if (!file_) {
    throw std::logic_error(std::string(kWho) + ": used after being moved from");
  }
  detail::flush(file_.get(), path_, kWho);
  last_flush_ = monotonic_seconds();
}

void TensorBoardWriter::write_event(const std::string& event) {
  if (!file_) {
    throw std::logic_error(std::string(kWho) + ": used after being moved from");
  }
  detail::write_all(file_.get(), tfrecord_frame(event), path_, kWho);
  if (monotonic_seconds() - last_flush_ >= flush_interval_s_) {
    flush();
  }
}

}  // namespace d9d::track
