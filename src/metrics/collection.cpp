// d9d/metrics/collection.cpp — MetricCollection: named metrics synced by one packed all-reduce.
#include <stdexcept>
#include <string>

#include <d9d/metrics/collection.hpp>

#include "pending_sync.hpp"

namespace d9d::metrics {

MetricCollection::~MetricCollection() = default;
MetricCollection::MetricCollection(MetricCollection&&) noexcept = default;
MetricCollection& MetricCollection::operator=(MetricCollection&&) noexcept = default;

void MetricCollection::check_new_name(const std::string& name) const {
  if (name.empty() || name.front() == '/' || name.back() == '/') {
    throw std::invalid_argument("d9d::metrics::MetricCollection::add: invalid name '" + name +
                                "'; names are non-empty and neither start nor end with '/'");
  }
  if (contains(name)) {
    throw std::invalid_argument("d9d::metrics::MetricCollection::add: a metric named '" + name +
                                "' is already present");
  }
}

void MetricCollection::throw_wrong_kind(const std::string& name, const Metric& metric) {
  throw std::invalid_argument("d9d::metrics::MetricCollection::get: '" + name + "' is a " +
                              metric.kind() + ", not the kind asked for");
}

Metric& MetricCollection::at(const std::string& name) {
  for (auto& entry : entries_) {
    if (entry.name == name) {
      return *entry.metric;
    }
  }
  std::string present;
  for (const auto& entry : entries_) {
    present += (present.empty() ? "" : ", ") + entry.name;
  }
  throw std::out_of_range("d9d::metrics::MetricCollection: no metric named '" + name +
                          "' (present: " + (present.empty() ? "none" : present) + ")");
}

const Metric& MetricCollection::at(const std::string& name) const {
  return const_cast<MetricCollection*>(this)->at(name);  // NOLINT: same lookup, const result
}

bool MetricCollection::contains(const std::string& name) const {
  for (const auto& entry : entries_) {
    if (entry.name == name) {
      return true;
    }
  }
  return false;
}

std::vector<std::string> MetricCollection::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& entry : entries_) {
    out.push_back(entry.name);
  }
  return out;
}

void MetricCollection::reset() {
  for (auto& entry : entries_) {
    entry.metric->reset();
  }
}

void MetricCollection::sync_start(const ProcessGroup& group) {
  std::vector<at::Tensor> states;
  std::vector<Reduction> reductions;
  for (const auto& entry : entries_) {
    if (entry.metric->sync_pending()) {
      throw std::logic_error("d9d::metrics::MetricCollection::sync_start: metric '" + entry.name +
                             "' has a sync pending; call sync_wait() before the next sync_start");
    }
    for (std::size_t i = 0; i < entry.metric->slots().size(); ++i) {
      states.push_back(entry.metric->state()[i]);
      reductions.push_back(entry.metric->slots()[i].reduction);
    }
  }
  auto pending = std::make_shared<detail::PendingSync>(group, states, reductions);
  std::size_t first = 0;
  for (auto& entry : entries_) {
    entry.metric->attach_pending(pending, first);
    first += entry.metric->slots().size();
  }
}

void MetricCollection::sync_wait() {
  for (auto& entry : entries_) {
    entry.metric->sync_wait();
  }
}

bool MetricCollection::sync_pending() const {
  for (const auto& entry : entries_) {
    if (entry.metric->sync_pending()) {
      return true;
    }
  }
  return false;
}

void MetricCollection::add_prefixed(MetricValues& out, const std::string& name,
                                    const MetricValues& values) {
  for (const auto& [key, value] : values) {
    out[key.empty() ? name : name + "/" + key] = value;
  }
}

MetricValues MetricCollection::compute() const {
  MetricValues out;
  for (const auto& entry : entries_) {
    add_prefixed(out, entry.name, entry.metric->values());
  }
  return out;
}

MetricValues MetricCollection::compute_synced() {
  MetricValues out;
  for (auto& entry : entries_) {
    add_prefixed(out, entry.name, entry.metric->synced_values());
  }
  return out;
}

}  // namespace d9d::metrics
