// d9d/model/detail/config_reader.hpp — the rules the Qwen3 and Qwen3-MoE config readers share
// (not a public API): one prefix on every message, strict JSON, unknown keys refused with a
// suggestion, sizes and flags checked alike.
//
//   constexpr detail::ConfigReader kReader{"d9d Qwen3 config: "};
//   const detail::Json json = kReader.parse_object(text);       // names the key a problem is under
//   kReader.reject_unknown_keys(json, known_keys, "; d9d reads ...");
//   const int64_t layers = kReader.read_size(*detail::find(json, "num_hidden_layers"),
//                                            "num_hidden_layers");
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <d9d/util/json.hpp>

namespace d9d::model::detail {

using Json = util::Json;

/// The largest size a config may give: every size fits an int, so nothing truncates downstream.
inline constexpr int64_t kMaxConfigSize = std::numeric_limits<int32_t>::max();

/// `"key"`.
[[nodiscard]] std::string in_quotes(std::string_view key);
/// A value in a message: its JSON, cut to 80 bytes.
[[nodiscard]] std::string shown(const Json& value);
/// `json[key]`, or nullptr when it is absent or null (transformers treats null as "not given").
[[nodiscard]] const Json* find(const Json& json, std::string_view key);

/// One config reader's checks; every message is a std::invalid_argument starting with `prefix`.
class ConfigReader {
 public:
  explicit constexpr ConfigReader(std::string_view prefix) : prefix_(prefix) {}

  [[nodiscard]] constexpr std::string_view prefix() const { return prefix_; }
  [[noreturn]] void fail(const std::string& message) const;
  /// `"key" = value is invalid; valid`.
  [[noreturn]] void bad(const std::string& key, const std::string& value,
                        const std::string& valid) const;

  /// `text` as a JSON object (util::parse_strict_json, 64 levels deep at most); a problem names
  /// the top-level key it is under.
  [[nodiscard]] Json parse_object(const std::string& text) const;
  /// Fails on the keys of `json` that are not in `known`, each with the closest known key as a
  /// suggestion (the first of equals in `known`'s order); `known_text` ends the message.
  void reject_unknown_keys(const Json& json, const std::vector<std::string_view>& known,
                           const std::string& known_text) const;
  /// An integer from `low` to kMaxConfigSize.
  [[nodiscard]] int64_t read_size(const Json& value, const std::string& key, int64_t low = 1) const;
  /// true or false.
  [[nodiscard]] bool read_bool(const Json& value, const std::string& key) const;

  /// Runs `read`, whose std::invalid_argument messages start with `from`'s prefix, and rethrows
  /// them with this reader's prefix instead (the MoE reader runs the dense one).
  template <class Read>
  decltype(auto) under_own_prefix(const ConfigReader& from, const Read& read) const {
    try {
      return read();
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(reprefixed(error.what(), from));
    }
  }

 private:
  [[nodiscard]] std::string reprefixed(const std::string& what, const ConfigReader& from) const;

  std::string_view prefix_;
};

}  // namespace d9d::model::detail
