// d9d/util/json.hpp — strict JSON reading for the library's formats (safetensors headers and
// indexes, model configs, the trainer's config, checkpoints' metadata).
//
//   d9d::util::Json json = d9d::util::parse_strict_json(text, /*max_depth=*/3);  // or JsonError
//   error.top_key();                              // the top-level key a JsonError was found under
//   message += d9d::util::short_dump(json["dtype"], 80);                          // "\"F32\""
//
// parse_strict_json refuses what nlohmann::json would silently accept: a key given twice in one
// object (nlohmann keeps the last), nesting deeper than the caller's format allows (which also
// bounds the recursion of later dumps), and bytes that are not UTF-8 (reported with their offset
// before the JSON parser sees them). Json is nlohmann::ordered_json: keys keep the file's order.
// No LibTorch.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

namespace d9d::util {

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

/// `json.dump()` cut to `max_bytes` with "...".
[[nodiscard]] std::string short_dump(const Json& json, std::size_t max_bytes = 64);

/// Parses UTF-8 JSON with no duplicate keys and at most `max_depth` nested objects/arrays (the
/// top-level value is depth 1). Throws JsonError.
[[nodiscard]] Json parse_strict_json(std::string_view text, int max_depth);

}  // namespace d9d::util
