// d9d/util/quote.hpp — untrusted text, keys and shapes written safely into error messages.
//
//   d9d::util::quoted(name);            // "\"embed\\x0a...\"": control and non-ASCII bytes escaped
//   d9d::util::quoted_keys(missing);    // "\"a\", \"b\", ... (and 3 more)"
//   d9d::util::shape_string(sizes);     // "[2, 3]" ("[]" for a scalar)
//   d9d::util::misfit({{"missing", missing}, {"unexpected", unexpected}});  // " missing a, b;"
//
// Keys and names come from files (safetensors headers, configs) and may hold any byte: these
// helpers keep a message printable and short. No LibTorch (shape_string takes any range of
// integers, e.g. at::IntArrayRef or std::vector<int64_t>).
#pragma once

#include <cstddef>
#include <initializer_list>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace d9d::util {

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
template <class Sizes>
[[nodiscard]] std::string shape_string(const Sizes& sizes) {
  std::string out = "[";
  bool first = true;
  for (const auto size : sizes) {
    out += (first ? "" : ", ") + std::to_string(size);
    first = false;
  }
  return out + "]";
}

/// Up to 8 names as they are, comma-separated, then ", ... (N in all)".
[[nodiscard]] std::string name_list(const std::vector<std::string>& names);

/// What a checkpoint and a model disagree on, for a "does not fit" message: " <label> <names>;"
/// (name_list) for each non-empty list, in order; "" when every list is empty.
[[nodiscard]] std::string misfit(
    std::initializer_list<std::pair<std::string_view, const std::vector<std::string>&>> lists);

}  // namespace d9d::util
