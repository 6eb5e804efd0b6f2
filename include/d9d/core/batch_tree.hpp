// d9d/core/batch_tree.hpp — split a batch made of tensors into microbatches and merge it back.
//
//   struct Batch { at::Tensor input_ids, labels; int step = 0; };         // a plain aggregate
//   std::vector<Batch> micro = d9d::split_batch(batch, 4);   // every tensor along dim 0
//   Batch back = d9d::merge_batches(micro);
//   d9d::split_batch(batch, 4, [](std::string_view path) -> d9d::LeafSpec {
//     return path == "1" ? d9d::LeafSpec{d9d::ReplicateLeaf{}} : d9d::ShardAlong{1};
//   });
//
// A batch is a tree: at::Tensor leaves inside std::vector, std::tuple, std::pair, std::array,
// std::map<std::string, ...>, std::optional, plain aggregates (structs with public members, no
// constructors and no base class; up to 16 members, reached by position like Boost.PFR) and
// structs adapted for Boost.Hana (BOOST_HANA_ADAPT_STRUCT / BOOST_HANA_DEFINE_STRUCT, reached by
// name). Other leaves (numbers, strings) are copied into every part and taken from the first part
// when merging. A batch type in which the library finds no tensor (e.g. a class with private
// members or constructors) is a compile error naming the fix (concept d9d::splittable_batch).
// A spec says per tensor leaf how to split: ShardAlong{d} or ReplicateLeaf; give one spec for all
// leaves, or a function of the leaf's path ("labels" for a Hana member, "1" for an aggregate's
// second member, "inputs.ids", "features[2]", "extra{mask}", "pair.0").
//
// batch_layout_difference(a, b) says where two batches differ in layout, and copy_batch_(dst, src)
// copies one batch's tensors into another of the same layout (CUDA graphs' static inputs).
//
// Uneven rule: n rows in k parts give the first n % k parts floor(n/k) + 1 rows and the rest
// floor(n/k) (split_range); a sharded leaf with fewer than k rows is an error. Merging
// concatenates sharded leaves along their dimension and takes replicated leaves from part 0.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <boost/hana/accessors.hpp>
#include <boost/hana/at_key.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/hana/first.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/second.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>
#include <c10/util/StringUtil.h>

#include <d9d/core/detail/aggregate_fields.hpp>

namespace d9d {

/// Split this leaf along tensor dimension `dim`.
struct ShardAlong {
  int64_t dim = 0;
};
/// Give every part the whole leaf.
struct ReplicateLeaf {};
using LeafSpec = std::variant<ShardAlong, ReplicateLeaf>;
/// How each tensor leaf is split, by its path in the tree.
using BatchSpec = std::function<LeafSpec(std::string_view path)>;

/// Rows [offset, offset + length) of part `index` when `size` rows are split into `parts` parts:
/// the first size % parts parts get one row more.
struct SplitRange {
  int64_t offset = 0;
  int64_t length = 0;
};
[[nodiscard]] inline SplitRange split_range(int64_t size, int parts, int index) {
  const int64_t base = size / parts;
  const int64_t extra = size % parts;
  const int64_t offset = index * base + std::min<int64_t>(index, extra);
  return {.offset = offset, .length = base + (index < extra ? 1 : 0)};
}

namespace detail {

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_string_map : std::false_type {};
template <class T, class C, class A>
struct is_string_map<std::map<std::string, T, C, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_tuple_like : std::false_type {};
template <class... T>
struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class T, std::size_t N>
struct is_tuple_like<std::array<T, N>> : std::true_type {};

// An aggregate reached by position: not one of the containers above and not Hana-adapted.
template <class U>
concept positional_aggregate = plain_aggregate<U> && !is_tuple_like<U>::value &&
                               !boost::hana::Struct<U>::value && aggregate_field_count<U>() > 0;

template <class T>
consteval bool tree_has_tensor();

template <class U, class... P>
consteval bool hana_members_have_tensor(const boost::hana::tuple<P...>* /*accessors*/) {
  return (tree_has_tensor<decltype(boost::hana::second(std::declval<P>())(std::declval<U&>()))>() ||
          ...);
}

template <class... F>
consteval bool fields_have_tensor(const std::tuple<F...>* /*fields*/) {
  return (tree_has_tensor<F>() || ...);
}

// Whether a tree of type T can hold a tensor leaf that split_batch reaches.
template <class T>
consteval bool tree_has_tensor() {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::same_as<U, at::Tensor>) {
    return true;
  } else if constexpr (is_vector<U>::value || is_optional<U>::value) {
    return tree_has_tensor<typename U::value_type>();
  } else if constexpr (is_string_map<U>::value) {
    return tree_has_tensor<typename U::mapped_type>();
  } else if constexpr (is_tuple_like<U>::value) {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (tree_has_tensor<std::tuple_element_t<I, U>>() || ...);
    }
    (std::make_index_sequence<std::tuple_size_v<U>>{});
  } else if constexpr (boost::hana::Struct<U>::value) {
    return hana_members_have_tensor<U>(
        static_cast<const decltype(boost::hana::accessors<U>())*>(nullptr));
  } else if constexpr (positional_aggregate<U>) {
    return fields_have_tensor(static_cast<const aggregate_field_types_t<U>*>(nullptr));
  } else {
    return false;
  }
}

inline std::string join(std::string_view path, std::string_view name) {
  return path.empty() ? std::string(name) : std::string(path) + "." + std::string(name);
}

inline int64_t checked_dim(const at::Tensor& tensor, int64_t dim, std::string_view path) {
  const int64_t rank = tensor.dim();
  if (dim < -rank || dim >= rank || rank == 0) {
    throw std::invalid_argument("d9d batch: leaf \"" + std::string(path) + "\" has " +
                                std::to_string(rank) + " dimensions; cannot split along dim " +
                                std::to_string(dim));
  }
  return dim < 0 ? dim + rank : dim;
}

// Applies `leaf(path, tensor)` to every tensor leaf, building a tree of the same type.
template <class T, class Leaf>
T map_tree(const T& tree, const std::string& path, const Leaf& leaf) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::same_as<U, at::Tensor>) {
    return leaf(path, tree);
  } else if constexpr (is_vector<U>::value) {
    U out;
    out.reserve(tree.size());
    for (std::size_t i = 0; i < tree.size(); ++i) {
      out.push_back(map_tree(tree[i], path + "[" + std::to_string(i) + "]", leaf));
    }
    return out;
  } else if constexpr (is_string_map<U>::value) {
    U out;
    for (const auto& [key, value] : tree) {
      out.emplace(key, map_tree(value, path + "{" + key + "}", leaf));
    }
    return out;
  } else if constexpr (is_optional<U>::value) {
    return tree ? U(map_tree(*tree, path, leaf)) : U();
  } else if constexpr (is_tuple_like<U>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return U{map_tree(std::get<I>(tree), join(path, std::to_string(I)), leaf)...};
    }
    (std::make_index_sequence<std::tuple_size_v<U>>{});
  } else if constexpr (boost::hana::Struct<U>::value) {
    U out = tree;
    boost::hana::for_each(boost::hana::accessors<U>(), [&](auto member) {
      const std::string name = boost::hana::to<char const*>(boost::hana::first(member));
      auto get = boost::hana::second(member);
      get(out) = map_tree(get(tree), join(path, name), leaf);
    });
    return out;
  } else if constexpr (positional_aggregate<U>) {
    U out = tree;
    auto to = aggregate_fields(out);
    const auto from = aggregate_fields(tree);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((std::get<I>(to) = map_tree(std::get<I>(from), join(path, std::to_string(I)), leaf)), ...);
    }
    (std::make_index_sequence<std::tuple_size_v<decltype(to)>>{});
    return out;
  } else {
    return tree;  // a non-tensor leaf: copied
  }
}

// Combines the corresponding tensor leaves of `trees` (all of the same shape) with
// `leaf(path, leaves)`; non-tensor leaves come from trees[0].
template <class T, class Leaf>
T zip_trees(const std::vector<const T*>& trees, const std::string& path, const Leaf& leaf) {
  using U = std::remove_cvref_t<T>;
  const U& first = *trees.front();
  const auto pick = [&](auto&& get) {
    using Child = std::remove_cvref_t<decltype(get(first))>;
    std::vector<const Child*> children;
    children.reserve(trees.size());
    for (const auto* tree : trees) {
      children.push_back(&get(*tree));
    }
    return children;
  };
  if constexpr (std::same_as<U, at::Tensor>) {
    std::vector<at::Tensor> leaves;
    leaves.reserve(trees.size());
    for (const auto* tree : trees) {
      leaves.push_back(*tree);
    }
    return leaf(path, leaves);
  } else if constexpr (is_vector<U>::value) {
    for (const auto* tree : trees) {
      if (tree->size() != first.size()) {
        throw std::invalid_argument("d9d batch: parts differ in the length of \"" + path + "\"");
      }
    }
    U out;
    out.reserve(first.size());
    for (std::size_t i = 0; i < first.size(); ++i) {
      out.push_back(zip_trees(pick([i](const U& t) -> const auto& { return t[i]; }),
                              path + "[" + std::to_string(i) + "]", leaf));
    }
    return out;
  } else if constexpr (is_string_map<U>::value) {
    U out;
    for (const auto& entry : first) {
      const std::string& key = entry.first;  // a plain reference: lambdas can capture it
      for (const auto* tree : trees) {
        if (tree->count(key) == 0) {
          throw std::invalid_argument("d9d batch: a part lacks key \"" + key + "\" of \"" + path +
                                      "\"");
        }
      }
      out.emplace(key, zip_trees(pick([&key](const U& t) -> const auto& { return t.at(key); }),
                                 path + "{" + key + "}", leaf));
    }
    return out;
  } else if constexpr (is_optional<U>::value) {
    if (!first) {
      return U();
    }
    return U(zip_trees(pick([](const U& t) -> const auto& { return t.value(); }), path, leaf));
  } else if constexpr (is_tuple_like<U>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return U{zip_trees(pick([](const U& t) -> const auto& { return std::get<I>(t); }),
                         join(path, std::to_string(I)), leaf)...};
    }
    (std::make_index_sequence<std::tuple_size_v<U>>{});
  } else if constexpr (boost::hana::Struct<U>::value) {
    U out = first;
    boost::hana::for_each(boost::hana::accessors<U>(), [&](auto member) {
      const std::string name = boost::hana::to<char const*>(boost::hana::first(member));
      auto get = boost::hana::second(member);
      get(out) = zip_trees(pick([&get](const U& t) -> const auto& { return get(t); }),
                           join(path, name), leaf);
    });
    return out;
  } else if constexpr (positional_aggregate<U>) {
    U out = first;
    auto to = aggregate_fields(out);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((std::get<I>(to) = zip_trees(
            pick([](const U& t) -> const auto& { return std::get<I>(aggregate_fields(t)); }),
            join(path, std::to_string(I)), leaf)),
       ...);
    }
    (std::make_index_sequence<std::tuple_size_v<decltype(to)>>{});
    return out;
  } else {
    return first;
  }
}

inline BatchSpec to_spec(LeafSpec spec) {
  return [spec](std::string_view /*path*/) { return spec; };
}
inline BatchSpec to_spec(BatchSpec spec) { return spec; }
inline BatchSpec to_spec(ShardAlong spec) { return to_spec(LeafSpec{spec}); }
inline BatchSpec to_spec(ReplicateLeaf spec) { return to_spec(LeafSpec{spec}); }

// The first difference between the layouts of `a` and `b` ("" when there is none): container
// lengths and keys, tensor leaves' definedness, sizes and dtypes (not devices: a copy moves data),
// and the values of the other leaves (a leaf type without == differs, as nothing can say it is
// the same).
template <class T>
std::string layout_difference(const T& a, const T& b, const std::string& path) {
  using U = std::remove_cvref_t<T>;
  const auto where = [&] {
    return "\"" + (path.empty() ? std::string("(the batch)") : path) + "\"";
  };
  if constexpr (std::same_as<U, at::Tensor>) {
    if (a.defined() != b.defined()) {
      return where() + " is defined in one batch only";
    }
    if (a.defined() && (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())) {
      return where() + " has sizes " + c10::str(a.sizes()) + " " + c10::str(a.scalar_type()) +
             " against " + c10::str(b.sizes()) + " " + c10::str(b.scalar_type());
    }
    return "";
  } else if constexpr (is_vector<U>::value) {
    if (a.size() != b.size()) {
      return where() + " has " + std::to_string(a.size()) + " elements against " +
             std::to_string(b.size());
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      auto d = layout_difference(a[i], b[i], path + "[" + std::to_string(i) + "]");
      if (!d.empty()) {
        return d;
      }
    }
    return "";
  } else if constexpr (is_string_map<U>::value) {
    if (a.size() != b.size()) {
      return where() + " has " + std::to_string(a.size()) + " keys against " +
             std::to_string(b.size());
    }
    for (const auto& [key, value] : a) {
      const auto other = b.find(key);
      if (other == b.end()) {
        return where() + " has key \"" + key + "\" in one batch only";
      }
      auto d = layout_difference(value, other->second, path + "{" + key + "}");
      if (!d.empty()) {
        return d;
      }
    }
    return "";
  } else if constexpr (is_optional<U>::value) {
    if (a.has_value() != b.has_value()) {
      return where() + " is set in one batch only";
    }
    return a ? layout_difference(*a, *b, path) : std::string();
  } else if constexpr (is_tuple_like<U>::value) {
    std::string d;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((d.empty() ? (void)(d = layout_difference(std::get<I>(a), std::get<I>(b),
                                                 join(path, std::to_string(I))))
                  : (void)0),
       ...);
    }
    (std::make_index_sequence<std::tuple_size_v<U>>{});
    return d;
  } else if constexpr (boost::hana::Struct<U>::value) {
    std::string d;
    boost::hana::for_each(boost::hana::accessors<U>(), [&](auto member) {
      if (d.empty()) {
        const std::string name = boost::hana::to<char const*>(boost::hana::first(member));
        auto get = boost::hana::second(member);
        d = layout_difference(get(a), get(b), join(path, name));
      }
    });
    return d;
  } else if constexpr (positional_aggregate<U>) {
    const auto fa = aggregate_fields(a);
    const auto fb = aggregate_fields(b);
    std::string d;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((d.empty() ? (void)(d = layout_difference(std::get<I>(fa), std::get<I>(fb),
                                                 join(path, std::to_string(I))))
                  : (void)0),
       ...);
    }
    (std::make_index_sequence<std::tuple_size_v<decltype(fa)>>{});
    return d;
  } else if constexpr (std::equality_comparable<U>) {
    return a == b ? std::string() : where() + " differs (a value that is not a tensor)";
  } else {
    return where() + " has no operator== (a value that is not a tensor)";
  }
}

}  // namespace detail

/// Why one batch cannot be copied into another of its type ("" when it can): the first
/// difference in their trees (lengths, keys, tensor sizes or dtypes, other values; devices may
/// differ).
/// CUDA graphs replay a captured microbatch only for batches with its layout.
template <class Tree>
[[nodiscard]] std::string batch_layout_difference(const Tree& a, const Tree& b) {
  return detail::layout_difference(a, b, "");
}

/// Copies every tensor leaf of `src` into the same leaf of `dst` in place, across devices too
/// (`non_blocking` as at::Tensor::copy_); the batches must have the same layout
/// (std::invalid_argument naming the difference, before anything is copied).
template <class Tree>
void copy_batch_(Tree& dst, const Tree& src, bool non_blocking = false) {
  if (auto d = batch_layout_difference(dst, src); !d.empty()) {
    throw std::invalid_argument("d9d::copy_batch_: the batches differ: " + d);
  }
  (void)detail::zip_trees(std::vector<const Tree*>{&dst, &src}, "",
                          [&](const std::string& /*path*/, const std::vector<at::Tensor>& leaves) {
                            if (leaves[0].defined()) {
                              leaves[0].copy_(leaves[1], non_blocking);
                            }
                            return leaves[0];
                          });
}

/// A batch type split_batch can split: a tree (see the file comment) with at least one tensor leaf.
template <class T>
concept splittable_batch = detail::tree_has_tensor<T>();

/// The diagnostic for a batch type that is not splittable_batch, shared by split_batch,
/// merge_batches and the Trainer.
// NOLINTNEXTLINE(cppcoreguidelines-macro-usage): static_assert needs a string literal
#define D9D_UNSPLITTABLE_BATCH_FIX                                                               \
  "holds no tensor the library can split (the batch type is shown with this error). A batch is " \
  "an at::Tensor, a std::vector / std::optional / std::array / std::tuple / std::pair / "        \
  "std::map<std::string, ...> of batches, or a struct of them. Fix: make the struct a plain "    \
  "aggregate (public members, no constructors, no base class, at most 16 members), or adapt it " \
  "with BOOST_HANA_ADAPT_STRUCT(MyBatch, member1, member2, ...) from "                           \
  "<boost/hana/adapt_struct.hpp>"

/// Splits `batch` into `parts` microbatches (see the file comment for the rules).
template <class Tree, class Spec = ShardAlong>
std::vector<Tree> split_batch(const Tree& batch, int parts, Spec spec = ShardAlong{0}) {
  static_assert(splittable_batch<Tree>,
                "d9d::split_batch: the batch type " D9D_UNSPLITTABLE_BATCH_FIX);
  if (parts < 1) {
    throw std::invalid_argument("d9d::split_batch: parts must be >= 1, got " +
                                std::to_string(parts));
  }
  const BatchSpec leaf_spec = detail::to_spec(std::move(spec));
  std::vector<Tree> out;
  out.reserve(static_cast<std::size_t>(parts));
  for (int index = 0; index < parts; ++index) {
    out.push_back(detail::map_tree(batch, "", [&](const std::string& path, const at::Tensor& t) {
      if (!t.defined()) {
        return t;
      }
      const LeafSpec rule = leaf_spec(path);
      if (std::holds_alternative<ReplicateLeaf>(rule)) {
        return t;
      }
      const int64_t dim = detail::checked_dim(t, std::get<ShardAlong>(rule).dim, path);
      if (t.size(dim) < parts) {
        throw std::invalid_argument("d9d::split_batch: leaf \"" + path + "\" has " +
                                    std::to_string(t.size(dim)) + " rows along dim " +
                                    std::to_string(dim) + ", fewer than the " +
                                    std::to_string(parts) + " parts asked for");
      }
      const auto range = split_range(t.size(dim), parts, index);
      return t.narrow(dim, range.offset, range.length);
    }));
  }
  return out;
}

/// Merges microbatches made by split_batch (with the same spec) back into one batch.
template <class Tree, class Spec = ShardAlong>
Tree merge_batches(const std::vector<Tree>& parts, Spec spec = ShardAlong{0}) {
  static_assert(splittable_batch<Tree>,
                "d9d::merge_batches: the batch type " D9D_UNSPLITTABLE_BATCH_FIX);
  if (parts.empty()) {
    throw std::invalid_argument("d9d::merge_batches: no parts to merge");
  }
  const BatchSpec leaf_spec = detail::to_spec(std::move(spec));
  std::vector<const Tree*> trees;
  trees.reserve(parts.size());
  for (const auto& part : parts) {
    trees.push_back(&part);
  }
  return detail::zip_trees(
      trees, "", [&](const std::string& path, const std::vector<at::Tensor>& leaves) {
        if (!leaves.front().defined()) {
          return leaves.front();
        }
        const LeafSpec rule = leaf_spec(path);
        if (std::holds_alternative<ReplicateLeaf>(rule)) {
          return leaves.front();
        }
        const int64_t dim =
            detail::checked_dim(leaves.front(), std::get<ShardAlong>(rule).dim, path);
        return at::cat(leaves, dim);
      });
}

}  // namespace d9d
