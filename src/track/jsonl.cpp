// JSON-lines metrics: nlohmann::ordered_json keeps the keys in the caller's order.
#include <cmath>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <d9d/track/jsonl.hpp>
#include <d9d/util/files.hpp>

namespace d9d::track {

namespace {

constexpr std::string_view kWho = "d9d::track::JsonlWriter";

}  // namespace

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  d9d::files::create_directories(d9d::files::parent(path_), kWho);
  file_ = detail::open_file(path_, "ab", kWho);
}

void JsonlWriter::write(std::int64_t step,
                        const std::vector<std::pair<std::string, double>>& scalars,
                        std::optional<double> wall_time) {
  if (!file_) {
    throw std::logic_error(std::string(kWho) + ": used after being moved from");
  }
  nlohmann::ordered_json line;
  line["step"] = step;
  line["wall_time"] = wall_time.value_or(detail::unix_time_now());
  for (const auto& [key, value] : scalars) {
    if (line.contains(key)) {
      throw std::invalid_argument(std::string(kWho) + "::write: key \"" + key +
                                  "\" is reserved or given twice. Fix: rename the metric");
    }
    // JSON has no NaN or infinity: null keeps the line valid (and the key present).
    line[key] = std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json();
  }
  // Invalid UTF-8 in a key is replaced (U+FFFD) rather than thrown at the training loop.
  const std::string text =
      line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  detail::write_all(file_.get(), text, path_, kWho);
  detail::flush(file_.get(), path_, kWho);
}

}  // namespace d9d::track
