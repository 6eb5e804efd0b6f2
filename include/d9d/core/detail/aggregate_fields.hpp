// d9d/core/detail/aggregate_fields.hpp — the members of a plain aggregate, without adapting it.
//
//   struct Batch { at::Tensor features, labels; };
//   static_assert(d9d::detail::aggregate_field_count<Batch>() == 2);
//   auto [features, labels] = d9d::detail::aggregate_fields(batch);   // a std::tuple of references
//
// What Boost.PFR does (Debian 12's Boost 1.74 has no PFR): the field count is the largest N for
// which `T{x0, ..., xN-1}` compiles with placeholders convertible to anything; the fields are then
// reached through a structured binding of that many names. Aggregates without base classes and
// with at most kMaxAggregateFields members.
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace d9d::detail {

inline constexpr std::size_t kMaxAggregateFields = 16;

// Converts to any type; only used in unevaluated contexts.
struct any_field {
  template <class T>
  operator T() const;  // NOLINT(google-explicit-constructor): the point is the implicit conversion
};

template <class T, std::size_t... I>
consteval bool brace_constructible(std::index_sequence<I...> /*unused*/) {
  return requires { T{(static_cast<void>(I), any_field{})...}; };
}

/// A class aggregate that is not a union (what aggregate_fields can take apart).
template <class T>
concept plain_aggregate =
    std::is_class_v<T> && std::is_aggregate_v<T> && !std::is_union_v<T> && !std::is_array_v<T>;

/// The number of fields of aggregate T (0 when it has none or more than kMaxAggregateFields).
template <plain_aggregate T, std::size_t N = kMaxAggregateFields + 1>
consteval std::size_t aggregate_field_count() {
  if constexpr (N == 0) {
    return 0;
  } else if constexpr (brace_constructible<T>(std::make_index_sequence<N>{})) {
    return N > kMaxAggregateFields ? 0 : N;
  } else {
    return aggregate_field_count<T, N - 1>();
  }
}

/// A std::tuple of references to the fields of aggregate `tree` (const when `tree` is).
template <class T>
requires plain_aggregate<std::remove_const_t<T>>
auto aggregate_fields(T& tree) {
  constexpr std::size_t N = aggregate_field_count<std::remove_const_t<T>>();
  if constexpr (N == 0) {
    return std::tuple<>{};
  } else if constexpr (N == 1) {
    auto& [f0] = tree;
    return std::tie(f0);
  } else if constexpr (N == 2) {
    auto& [f0, f1] = tree;
    return std::tie(f0, f1);
  } else if constexpr (N == 3) {
    auto& [f0, f1, f2] = tree;
    return std::tie(f0, f1, f2);
  } else if constexpr (N == 4) {
    auto& [f0, f1, f2, f3] = tree;
    return std::tie(f0, f1, f2, f3);
  } else if constexpr (N == 5) {
    auto& [f0, f1, f2, f3, f4] = tree;
    return std::tie(f0, f1, f2, f3, f4);
  } else if constexpr (N == 6) {
    auto& [f0, f1, f2, f3, f4, f5] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5);
  } else if constexpr (N == 7) {
    auto& [f0, f1, f2, f3, f4, f5, f6] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6);
  } else if constexpr (N == 8) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7);
  } else if constexpr (N == 9) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8);
  } else if constexpr (N == 10) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9);
  } else if constexpr (N == 11) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10);
  } else if constexpr (N == 12) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11);
  } else if constexpr (N == 13) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12);
  } else if constexpr (N == 14) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13);
  } else if constexpr (N == 15) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14);
  } else if constexpr (N == 16) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15] = tree;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15);
  }
}

template <class Tuple>
struct decayed_tuple;
template <class... F>
struct decayed_tuple<std::tuple<F...>> {
  using type = std::tuple<std::remove_cvref_t<F>...>;
};

/// The field types of aggregate T, as a std::tuple of the plain types.
template <plain_aggregate T>
using aggregate_field_types_t =
    typename decayed_tuple<decltype(aggregate_fields(std::declval<T&>()))>::type;

}  // namespace d9d::detail
