// d9d/state/detail/io.hpp — what the safetensors reader and writer share (not a public API).
//
//   detail::AtomicFile out(path, who);  out.write(bytes, n);  out.commit();  // <path>.tmp, rename
//   auto json = detail::parse_strict_json(text, /*max_depth=*/3);             // throws JsonError
//
// parse_strict_json refuses what nlohmann::json would silently accept: a key given twice in one
// object (nlohmann keeps the last), nesting deeper than the caller's format allows (which also
// bounds the recursion of later dumps), and bytes that are not UTF-8 (reported with their offset
// before the JSON parser sees them).
#pragma once

#include <cstddef>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <c10/util/ArrayRef.h>
#include <nlohmann/json.hpp>

namespace d9d::state::detail {

using Json = nlohmann::ordered_json;

/// A problem found by parse_strict_json. `top_key` is the key of the top-level object under which
/// it was found ("" when at the top level or outside any key).
class JsonError : public std::runtime_error {
 public:
  JsonError(const std::string& what, std::string top_key)
      : std::runtime_error(what), top_key_(std::move(top_key)) {}
  [[nodiscard]] const std::string& top_key() const { return top_key_; }

 private:
  std::string top_key_;
};

/// Byte offset of the first invalid UTF-8 sequence of `text` (RFC 3629: no overlong forms, no
/// surrogates, nothing past U+10FFFF), or std::string_view::npos when it is all valid.
[[nodiscard]] std::size_t first_invalid_utf8(std::string_view text);

/// `text` with control and non-ASCII bytes escaped (\xNN), cut to `max_bytes` with "..." — safe to
/// put in an error message.
[[nodiscard]] std::string printable(std::string_view text, std::size_t max_bytes = 64);

/// `"text"`: printable(text, max_bytes) in double quotes, for naming a thing in an error message.
[[nodiscard]] std::string quoted(std::string_view text, std::size_t max_bytes = 64);

/// A tensor or state key in an error message: quoted(key, 200).
[[nodiscard]] std::string quoted_key(std::string_view key);

/// Up to `max_listed` keys as quoted_key, comma-separated, then " (and N more)".
template <class Range>
[[nodiscard]] std::string quoted_keys(const Range& keys, std::size_t max_listed = 8) {
  std::string out;
  std::size_t n = 0;
  for (const auto& key : keys) {
    if (n == max_listed) {
      out += " (and " + std::to_string(std::size(keys) - max_listed) + " more)";
      break;
    }
    out += (n == 0 ? "" : ", ") + quoted_key(key);
    ++n;
  }
  return out;
}

/// Tensor sizes as "[2, 3]" ("[]" for a scalar), for error messages.
[[nodiscard]] std::string shape_string(c10::IntArrayRef sizes);

/// `json.dump()` cut to `max_bytes` with "...".
[[nodiscard]] std::string short_dump(const Json& json, std::size_t max_bytes = 64);

/// Parses UTF-8 JSON with no duplicate keys and at most `max_depth` nested objects/arrays (the
/// top-level value is depth 1). Throws JsonError.
[[nodiscard]] Json parse_strict_json(std::string_view text, int max_depth);

/// A file written as `<path>.tmp` and renamed over `path` by commit() after fsync, so readers see
/// the old file or the whole new one. Destroyed without commit(): the temporary is removed.
/// Errors: std::runtime_error "<who>: <path>.tmp: <what> (<strerror>)".
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string who);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile(AtomicFile&&) = delete;
  AtomicFile& operator=(AtomicFile&&) = delete;
  ~AtomicFile();

  void write(const void* data, std::size_t size);
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  std::string tmp_;
  std::string who_;
  int fd_ = -1;
};

/// fsyncs the directory `dir`, so renames inside it survive a crash; errors are ignored (some file
/// systems refuse fsync on directories).
void sync_directory(const std::string& dir);

}  // namespace d9d::state::detail
