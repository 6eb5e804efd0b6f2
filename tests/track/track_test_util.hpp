// Helpers of the track tests: scratch directories, whole-file reads, and a small independent
// reader of TFRecord files and of the Event messages the writer produces.
// Paths are std::string handled with POSIX calls (mkdtemp, mkdir, nftw), like the library: the
// C++17 file-system library is not used anywhere (LibTorch exports its own copies of it).
#pragma once

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <ftw.h>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <utility>
#include <vector>

#include <d9d/track/tfrecord.hpp>

#include "tests/support/read_file.hpp"

namespace track_test {

namespace detail {

inline int remove_entry(const char* path, const struct stat* /*info*/, int /*flag*/,
                        struct FTW* /*ftw*/) {
  return std::remove(path);
}

/// mkdir `dir`, which may exist already; throws naming the path and the reason.
inline void make_directory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) {
    throw std::runtime_error("track_test: cannot create directory '" + dir +
                             "': " + std::strerror(errno));
  }
}

/// The directory all scratch directories of this process go in: Bazel's TEST_TMPDIR, else a new
/// directory under TMPDIR (or /tmp).
inline const std::string& scratch_base() {
  static const std::string base = [] {
    if (const char* bazel_tmp = std::getenv("TEST_TMPDIR");
        bazel_tmp != nullptr && *bazel_tmp != '\0') {
      return std::string(bazel_tmp);
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/d9d_track_test_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("track_test: mkdtemp '" + pattern + "': " + std::strerror(errno));
    }
    return pattern;
  }();
  return base;
}

}  // namespace detail

/// Removes `path` and everything under it (nothing when it does not exist).
inline void remove_tree(const std::string& path) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) == 0 &&
      ::nftw(path.c_str(), detail::remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    throw std::runtime_error("track_test: cannot remove '" + path + "': " + std::strerror(errno));
  }
}

/// An empty directory for one test, <scratch base>/<name> (no trailing slash).
inline std::string scratch_dir(std::string_view name) {
  const std::string dir = detail::scratch_base() + "/" + std::string(name);
  remove_tree(dir);
  detail::make_directory(dir);
  return dir;
}

/// The part of `path` before its last '/' ("" when it has none).
inline std::string dir_name(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

/// The part of `path` after its last '/'.
inline std::string base_name(const std::string& path) {
  return path.substr(path.rfind('/') + 1);  // npos + 1 == 0: the whole path
}

using d9d::testing::read_file;

inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  return lines;
}

inline std::uint64_t read_le(std::string_view bytes, std::size_t at, int count) {
  std::uint64_t value = 0;
  for (int i = 0; i < count; ++i) {
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  }
  return value;
}

/// The payloads of a TFRecord file; throws on a bad length or CRC.
inline std::vector<std::string> read_records(std::string_view bytes) {
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < 12) {
      throw std::runtime_error("truncated record header at byte " + std::to_string(at));
    }
    const std::uint64_t length = read_le(bytes, at, 8);
    if (read_le(bytes, at + 8, 4) != d9d::track::masked_crc32c(bytes.substr(at, 8))) {
      throw std::runtime_error("bad length CRC at byte " + std::to_string(at));
    }
    if (bytes.size() - at - 12 < length + 4) {
      throw std::runtime_error("truncated record at byte " + std::to_string(at));
    }
    const std::string_view payload = bytes.substr(at + 12, length);
    if (read_le(bytes, at + 12 + length, 4) != d9d::track::masked_crc32c(payload)) {
      throw std::runtime_error("bad data CRC at byte " + std::to_string(at));
    }
    records.emplace_back(payload);
    at += 16 + length;
  }
  return records;
}

/// What the tests need of a decoded tensorflow.Event.
struct Event {
  std::optional<double> wall_time;
  std::int64_t step = 0;
  std::optional<std::string> file_version;
  std::vector<std::pair<std::string, float>> values;
};

class ProtoReader {
 public:
  explicit ProtoReader(std::string_view bytes) : bytes_(bytes) {}
  [[nodiscard]] bool done() const { return at_ >= bytes_.size(); }
  std::uint64_t varint() {
    std::uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const auto byte = static_cast<unsigned char>(bytes_.at(at_++));
      value |= static_cast<std::uint64_t>(byte & 0x7FU) << shift;
      if ((byte & 0x80U) == 0) {
        return value;
      }
    }
    throw std::runtime_error("varint longer than 10 bytes");
  }
  std::uint64_t fixed(int count) {
    if (bytes_.size() - at_ < static_cast<std::size_t>(count)) {
      throw std::runtime_error("truncated fixed field");
    }
    const std::uint64_t value = read_le(bytes_, at_, count);
    at_ += count;
    return value;
  }
  std::string_view bytes() {
    const std::uint64_t length = varint();
    if (bytes_.size() - at_ < length) {
      throw std::runtime_error("truncated length-delimited field");
    }
    const std::string_view value = bytes_.substr(at_, length);
    at_ += length;
    return value;
  }

 private:
  std::string_view bytes_;
  std::size_t at_ = 0;
};

inline Event decode_event(std::string_view bytes) {
  Event event;
  ProtoReader event_reader(bytes);
  while (!event_reader.done()) {
    const std::uint64_t key = event_reader.varint();
    if (key == ((1U << 3) | 1U)) {
      event.wall_time = std::bit_cast<double>(event_reader.fixed(8));
    } else if (key == ((2U << 3) | 0U)) {
      event.step = static_cast<std::int64_t>(event_reader.varint());
    } else if (key == ((3U << 3) | 2U)) {
      event.file_version = std::string(event_reader.bytes());
    } else if (key == ((5U << 3) | 2U)) {
      ProtoReader summary(event_reader.bytes());
      while (!summary.done()) {
        if (summary.varint() != ((1U << 3) | 2U)) {
          throw std::runtime_error("unexpected field in Summary");
        }
        ProtoReader value(summary.bytes());
        std::pair<std::string, float> tag_value;
        while (!value.done()) {
          const std::uint64_t value_key = value.varint();
          if (value_key == ((1U << 3) | 2U)) {
            tag_value.first = std::string(value.bytes());
          } else if (value_key == ((2U << 3) | 5U)) {
            tag_value.second = std::bit_cast<float>(static_cast<std::uint32_t>(value.fixed(4)));
          } else {
            throw std::runtime_error("unexpected field in Summary.Value");
          }
        }
        event.values.push_back(tag_value);
      }
    } else {
      throw std::runtime_error("unexpected field in Event: key " + std::to_string(key));
    }
  }
  return event;
}

/// Every Event of an event file.
inline std::vector<Event> read_events(const std::string& path) {
  std::vector<Event> events;
  for (const std::string& record : read_records(read_file(path))) {
    events.push_back(decode_event(record));
  }
  return events;
}

/// "\x09\x00..." from "09 00 ..." (for byte-exact expectations).
inline std::string from_hex(std::string_view hex) {
  std::string bytes;
  std::istringstream in{std::string(hex)};
  for (std::string pair; in >> pair;) {
    bytes.push_back(static_cast<char>(std::stoi(pair, nullptr, 16)));
  }
  return bytes;
}

}  // namespace track_test
