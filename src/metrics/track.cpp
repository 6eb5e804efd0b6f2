// d9d/metrics/track.cpp — metric values through the d9d::track writers.
#include <d9d/metrics/track.hpp>

namespace d9d::metrics {

std::vector<std::pair<std::string, double>> to_scalars(const MetricValues& values,
                                                       const std::string& prefix) {
  std::vector<std::pair<std::string, double>> out;
  out.reserve(values.size());
  for (const auto& [key, value] : values) {
    std::string name;
    if (key.empty()) {
      name = prefix.empty() ? "value" : prefix;
      if (name.size() > 1 && name.back() == '/') {
        name.pop_back();
      }
    } else {
      name = prefix + key;
    }
    out.emplace_back(std::move(name), value);
  }
  return out;
}

void write_values(std::int64_t step, const MetricValues& values, const TrackSinks& sinks) {
  const auto scalars = to_scalars(values, sinks.prefix);
  if (sinks.jsonl != nullptr) {
    sinks.jsonl->write(step, scalars);
  }
  if (sinks.tensorboard != nullptr) {
    sinks.tensorboard->add_scalars(step, scalars);
  }
}

}  // namespace d9d::metrics
