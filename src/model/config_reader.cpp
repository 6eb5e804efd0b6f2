// d9d/model/config_reader.cpp — the rules the Qwen3 config readers share
// (d9d/model/detail/config_reader.hpp).
#include <algorithm>

#include <d9d/model/detail/config_reader.hpp>
#include <d9d/util/did_you_mean.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::model::detail {

std::string in_quotes(std::string_view key) { return "\"" + std::string(key) + "\""; }

std::string shown(const Json& value) { return util::short_dump(value, 80); }

const Json* find(const Json& json, std::string_view key) {
  const auto found = json.find(std::string(key));
  return found == json.end() || found->is_null() ? nullptr : &*found;
}

void ConfigReader::fail(const std::string& message) const {
  throw std::invalid_argument(std::string(prefix_) + message);
}

void ConfigReader::bad(const std::string& key, const std::string& value,
                       const std::string& valid) const {
  fail(in_quotes(key) + " = " + value + " is invalid; " + valid);
}

Json ConfigReader::parse_object(const std::string& text) const {
  Json json;
  try {
    json = util::parse_strict_json(text, 64);
  } catch (const util::JsonError& error) {
    if (error.top_key().empty()) {
      fail(std::string("not valid JSON: ") + error.what());
    }
    const std::string what = error.what();
    fail(in_quotes(error.top_key()) + (what.rfind("appears twice", 0) == 0 ? " " : ": ") + what);
  }
  if (!json.is_object()) {
    fail("expected a JSON object, got " + shown(json));
  }
  return json;
}

void ConfigReader::reject_unknown_keys(const Json& json, const std::vector<std::string_view>& known,
                                       const std::string& known_text) const {
  std::string listing;
  std::size_t unknown = 0;
  for (const auto& item : json.items()) {
    if (std::find(known.begin(), known.end(), item.key()) != known.end()) {
      continue;
    }
    const std::string best = util::closest_match(item.key(), known);
    listing += (unknown++ == 0 ? "" : ", ") + util::quoted(item.key(), 80) +
               (best.empty() ? "" : " (did you mean " + in_quotes(best) + "?)");
  }
  if (unknown > 0) {
    fail(std::string(unknown == 1 ? "unknown key " : "unknown keys ") + listing + known_text);
  }
}

int64_t ConfigReader::read_size(const Json& value, const std::string& key, int64_t low) const {
  const std::string valid =
      "expected an integer from " + std::to_string(low) + " to " + std::to_string(kMaxConfigSize);
  if (!value.is_number_integer() ||
      (value.is_number_unsigned()
           ? value.get<uint64_t>() > static_cast<uint64_t>(kMaxConfigSize)
           : (value.get<int64_t>() < low || value.get<int64_t>() > kMaxConfigSize))) {
    bad(key, shown(value), valid);
  }
  return value.get<int64_t>();
}

bool ConfigReader::read_bool(const Json& value, const std::string& key) const {
  if (!value.is_boolean()) {
    bad(key, shown(value), "expected true or false");
  }
  return value.get<bool>();
}

std::string ConfigReader::reprefixed(const std::string& what, const ConfigReader& from) const {
  if (what.rfind(from.prefix_, 0) == 0) {
    return std::string(prefix_) + what.substr(from.prefix_.size());
  }
  return what;
}

}  // namespace d9d::model::detail
