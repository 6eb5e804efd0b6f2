// d9d/util/quote.cpp — printable text for error messages (d9d/util/quote.hpp).
#include <algorithm>
#include <string>
#include <vector>

#include <d9d/util/quote.hpp>

namespace d9d::util {

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

std::string name_list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) {
    out += (i > 0 ? ", " : "") + names[i];
  }
  if (names.size() > 8) {
    out += ", ... (" + std::to_string(names.size()) + " in all)";
  }
  return out;
}

std::string misfit(
    std::initializer_list<std::pair<std::string_view, const std::vector<std::string>&>> lists) {
  std::string out;
  for (const auto& [label, names] : lists) {
    if (!names.empty()) {
      out += " " + std::string(label) + " " + name_list(names) + ";";
    }
  }
  return out;
}

}  // namespace d9d::util
