// d9d/state/io.cpp — strict JSON parsing and atomic file writing for d9d::state.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <set>
#include <unistd.h>
#include <vector>

#include <d9d/state/detail/io.hpp>

namespace d9d::state::detail {

std::size_t first_invalid_utf8(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t size = text.size();
  std::size_t i = 0;
  while (i < size) {
    const unsigned char lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    std::size_t length = 0;
    unsigned char low = 0x80;  // the range of the second byte (RFC 3629, table 3-7 of Unicode)
    unsigned char high = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      low = lead == 0xE0 ? 0xA0 : 0x80;   // no overlong forms
      high = lead == 0xED ? 0x9F : 0xBF;  // no surrogates
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      low = lead == 0xF0 ? 0x90 : 0x80;   // no overlong forms
      high = lead == 0xF4 ? 0x8F : 0xBF;  // nothing past U+10FFFF
    } else {
      return i;
    }
    if (size - i < length || bytes[i + 1] < low || bytes[i + 1] > high) {
      return i;
    }
    for (std::size_t k = 2; k < length; ++k) {
      if (bytes[i + k] < 0x80 || bytes[i + k] > 0xBF) {
        return i;
      }
    }
    i += length;
  }
  return std::string_view::npos;
}

std::string printable(std::string_view text, std::size_t max_bytes) {
  std::string out;
  const std::size_t shown = std::min(text.size(), max_bytes);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte >= 0x7F || byte == '\\') {
      constexpr std::string_view kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4U];
      out += kHex[byte & 0xFU];
    } else {
      out += static_cast<char>(byte);
    }
  }
  if (shown < text.size()) {
    out += "...";
  }
  return out;
}

std::string quoted(std::string_view text, std::size_t max_bytes) {
  return "\"" + printable(text, max_bytes) + "\"";
}

std::string quoted_key(std::string_view key) { return quoted(key, 200); }

std::string shape_string(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    out += (d == 0 ? "" : ", ") + std::to_string(sizes[d]);
  }
  return out + "]";
}

std::string short_dump(const Json& json, std::size_t max_bytes) {
  std::string text = json.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > max_bytes) {
    text.resize(max_bytes);
    text += "...";
  }
  return text;
}

Json parse_strict_json(std::string_view text, int max_depth) {
  if (const std::size_t bad = first_invalid_utf8(text); bad != std::string_view::npos) {
    const std::size_t from = bad < 32 ? 0 : bad - 32;
    throw JsonError("not valid UTF-8: byte 0x" + printable(text.substr(bad, 1)).substr(2) +
                        " at offset " + std::to_string(bad) + ", after \"" +
                        printable(text.substr(from, bad - from)) + "\"",
                    "");
  }
  // One frame per open object or array: the keys seen so far (objects only).
  struct Frame {
    bool object = false;
    std::set<std::string, std::less<>> keys;
  };
  std::vector<Frame> open;
  std::string top_key;
  const Json::parser_callback_t on_event = [&](int /*depth*/, Json::parse_event_t event,
                                               Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (static_cast<int>(open.size()) >= max_depth) {
          throw JsonError(
              "nested deeper than the " + std::to_string(max_depth) + " levels this format has",
              top_key);
        }
        open.push_back({.object = event == Json::parse_event_t::object_start, .keys = {}});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        open.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (open.size() == 1) {
          top_key = key;
        }
        if (!open.back().keys.insert(key).second) {
          throw JsonError(open.size() == 1
                              ? std::string("appears twice in the JSON object")
                              : "key \"" + printable(key) + "\" appears twice in its JSON object",
                          top_key);
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::exception& error) {
    throw JsonError("bad JSON (" + std::string(error.what()) + ")", "");
  }
}

// ---- AtomicFile ---------------------------------------------------------------------------------

AtomicFile::AtomicFile(std::string path, std::string who)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), who_(std::move(who)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    fail("cannot create");
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::fail(const std::string& what) const {
  const int error = errno;
  throw std::runtime_error(who_ + ": " + tmp_ + ": " + what + " (" + std::strerror(error) + ")");
}

void AtomicFile::write(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most 0x7ffff000 bytes per call.
    const ssize_t written = ::write(fd_, bytes, std::min<std::size_t>(size, std::size_t{1} << 30));
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      fail("write failed");
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) {
    fail("fsync failed");
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    errno = error;
    fail("close failed");
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    errno = error;
    fail("rename to " + path_ + " failed");
  }
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)::fsync(fd);
    ::close(fd);
  }
}

}  // namespace d9d::state::detail
