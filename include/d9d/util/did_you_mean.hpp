// d9d/util/did_you_mean.hpp — the closest known word to a misspelled one, for error messages.
//
//   const std::string best = d9d::util::closest_match("hiden_size", known_keys);  // "hidden_size"
//   if (!best.empty()) { message += " (did you mean \"" + best + "\"?)"; }
//
// Used by every config reader that rejects unknown keys (the trainer's config, the Qwen3 config),
// so their suggestions agree. No LibTorch.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace d9d::util {

/// The Levenshtein distance: single-character insertions, deletions and substitutions.
[[nodiscard]] std::size_t edit_distance(std::string_view a, std::string_view b);

/// The largest edit distance closest_match suggests across.
inline constexpr std::size_t kMaxSuggestionDistance = 3;

/// The candidate nearest to `word` (the first of equals, in the range's order) when it is at most
/// kMaxSuggestionDistance edits away, else "". `candidates`: any range of string-like values.
template <class Range>
[[nodiscard]] std::string closest_match(std::string_view word, const Range& candidates) {
  std::string best;
  std::size_t best_distance = kMaxSuggestionDistance + 1;
  for (const auto& candidate : candidates) {
    const std::size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = std::string(candidate);
    }
  }
  return best;
}

}  // namespace d9d::util
