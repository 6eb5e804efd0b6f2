// d9d/util/json.cpp — strict JSON parsing (d9d/util/json.hpp).
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <d9d/util/json.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::util {

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

}  // namespace d9d::util
