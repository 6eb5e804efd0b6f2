// d9d/core/batch_tree.hpp — split a batch made of tensors into microbatches and merge it back.
//
//   struct Batch { at::Tensor input_ids, labels; int step = 0; };
//   BOOST_HANA_ADAPT_STRUCT(Batch, input_ids, labels, step);
//   std::vector<Batch> micro = d9d::split_batch(batch, 4);               // every tensor along dim
//   0 Batch back = d9d::merge_batches(micro); d9d::split_batch(batch, 4, [](std::string_view path)
//   -> d9d::LeafSpec {
//     return path == "position_ids" ? d9d::LeafSpec{d9d::ReplicateLeaf{}} : d9d::ShardAlong{1};
//   });
//
// A batch is a tree: at::Tensor leaves inside std::vector, std::tuple, std::pair,
// std::map<std::string, ...>, std::optional and structs adapted for Boost.Hana
// (BOOST_HANA_ADAPT_STRUCT / BOOST_HANA_DEFINE_STRUCT). Other leaves (numbers, strings) are copied
// into every part and taken from the first part when merging. A spec says per tensor leaf how to
// split: ShardAlong{d} or ReplicateLeaf; give one spec for all leaves, or a function of the leaf's
// path ("labels", "inputs.ids", "features[2]", "extra{mask}", "pair.0").
//
// Uneven rule: n rows in k parts give the first n % k parts floor(n/k) + 1 rows and the rest
// floor(n/k) (split_range); a sharded leaf with fewer than k rows is an error. Merging
// concatenates sharded leaves along their dimension and takes replicated leaves from part 0.
#pragma once

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
      return U(map_tree(std::get<I>(tree), join(path, std::to_string(I)), leaf)...);
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
      return U(zip_trees(pick([](const U& t) -> const auto& { return std::get<I>(t); }),
                         join(path, std::to_string(I)), leaf)...);
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

}  // namespace detail

/// Splits `batch` into `parts` microbatches (see the file comment for the rules).
template <class Tree, class Spec = ShardAlong>
std::vector<Tree> split_batch(const Tree& batch, int parts, Spec spec = ShardAlong{0}) {
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
