// d9d/core/object_collectives.hpp — collectives of serialisable values (not tensors).
//
//   auto names = d9d::all_gather_object(group, std::string("shard-3"));      // one per rank
//   auto cfg = d9d::broadcast_object(ctx.world(), config_on_rank0, /*src=*/0);
//   auto stats = d9d::gather_object(group, std::map<std::string, double>{...}, /*dst=*/0);
//
// Serialisable means convertible to and from nlohmann::json: numbers, strings, booleans, standard
// containers of those, and user types with to_json / from_json. Values travel as MessagePack bytes
// through the byte collectives of core/collectives.hpp; sizes may differ between ranks.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <d9d/core/collectives.hpp>

namespace d9d {
namespace detail {

template <class T>
std::string to_bytes(const T& value) {
  const auto packed = nlohmann::json::to_msgpack(nlohmann::json(value));
  return {packed.begin(), packed.end()};
}

template <class T>
T from_bytes(const std::string& bytes) {
  return nlohmann::json::from_msgpack(bytes).get<T>();
}

}  // namespace detail

/// Every rank's value, in group order.
template <class T>
std::vector<T> all_gather_object(const ProcessGroup& group, const T& value) {
  std::vector<T> out;
  for (const auto& bytes : all_gather_bytes(group, detail::to_bytes(value))) {
    out.push_back(detail::from_bytes<T>(bytes));
  }
  return out;
}

/// Every rank's value on group rank `dst`; an empty vector elsewhere.
template <class T>
std::vector<T> gather_object(const ProcessGroup& group, const T& value, int dst) {
  std::vector<T> out;
  for (const auto& bytes : gather_bytes(group, detail::to_bytes(value), dst)) {
    out.push_back(detail::from_bytes<T>(bytes));
  }
  return out;
}

/// Group rank `src`'s value on every rank (the others' `value` is ignored).
template <class T>
T broadcast_object(const ProcessGroup& group, const T& value, int src) {
  return detail::from_bytes<T>(broadcast_bytes(group, detail::to_bytes(value), src));
}

}  // namespace d9d
