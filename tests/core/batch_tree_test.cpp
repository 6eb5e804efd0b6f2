// Tests of d9d/core/batch_tree.hpp for each supported batch form: every microbatch holds exactly
// its rows (rows are numbered, so a part that got all rows, or the wrong ones, is seen), merging
// gives the batch back, and which types are splittable at compile time.
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <boost/hana/adapt_struct.hpp>
#include <gtest/gtest.h>

#include <d9d/core/batch_tree.hpp>

namespace batch_test {

// A plain aggregate: reached by position without any adaptation.
struct Plain {
  at::Tensor features;
  at::Tensor labels;
  int step = 7;
  std::string name = "plain";
};

// Aggregates nest, and hold the other forms.
struct Nested {
  Plain inner;
  std::map<std::string, at::Tensor> extra;
  std::optional<at::Tensor> mask;
};

// Adapted for Hana: reached by name.
struct Named {
  at::Tensor ids;
  int step = 0;
};

// Not splittable: private members behind a constructor, not adapted.
class Opaque {
 public:
  explicit Opaque(at::Tensor rows) : rows_(std::move(rows)) {}

 private:
  at::Tensor rows_;
};

}  // namespace batch_test

BOOST_HANA_ADAPT_STRUCT(batch_test::Named, ids, step);

namespace {

using batch_test::Named;
using batch_test::Nested;
using batch_test::Plain;

static_assert(d9d::splittable_batch<at::Tensor>);
static_assert(d9d::splittable_batch<std::tuple<at::Tensor, at::Tensor>>);
static_assert(d9d::splittable_batch<std::pair<at::Tensor, int>>);
static_assert(d9d::splittable_batch<std::array<at::Tensor, 2>>);
static_assert(d9d::splittable_batch<std::map<std::string, at::Tensor>>);
static_assert(d9d::splittable_batch<std::vector<at::Tensor>>);
static_assert(d9d::splittable_batch<Plain>);
static_assert(d9d::splittable_batch<Nested>);
static_assert(d9d::splittable_batch<Named>);
static_assert(!d9d::splittable_batch<batch_test::Opaque>);
static_assert(!d9d::splittable_batch<int>);
static_assert(!d9d::splittable_batch<std::tuple<int, std::string>>);
static_assert(d9d::detail::aggregate_field_count<Plain>() == 4);
static_assert(d9d::detail::aggregate_field_count<Nested>() == 3);

// Rows numbered from `first`: row r of a [n, width] leaf holds the value first + r everywhere.
at::Tensor rows(int64_t n, int64_t width = 3, int64_t first = 0) {
  return at::arange(first, first + n, at::kLong).unsqueeze(1).expand({n, width}).contiguous();
}

// Whether `part` holds exactly rows [offset, offset + length) of rows(n, width, first).
void expect_rows(const at::Tensor& part, int64_t offset, int64_t length, int64_t first = 0) {
  ASSERT_EQ(part.size(0), length);
  const auto want = at::arange(first + offset, first + offset + length, at::kLong);
  EXPECT_TRUE(at::equal(part.dim() == 1 ? part : part.select(1, 0), want))
      << "rows " << part << " want " << want;
}

// 10 rows in 4 microbatches: 3, 3, 2, 2 (split_range).
constexpr int kParts = 4;
constexpr int64_t kRows = 10;

TEST(Core_BatchTree_Tensor, EachMicrobatchHoldsExactlyItsRows) {
  const auto batch = rows(kRows);
  const auto parts = d9d::split_batch(batch, kParts);
  ASSERT_EQ(parts.size(), kParts);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i], range.offset, range.length);
  }
  EXPECT_TRUE(at::equal(d9d::merge_batches(parts), batch));
}

TEST(Core_BatchTree_TupleAndPair, EachMicrobatchHoldsExactlyItsRows) {
  const auto batch = std::make_tuple(rows(kRows), rows(kRows, 1, 100).squeeze(1));
  const auto parts = d9d::split_batch(batch, kParts);
  const auto pair = std::make_pair(rows(kRows), 5);
  const auto pair_parts = d9d::split_batch(pair, kParts);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(std::get<0>(parts[i]), range.offset, range.length);
    expect_rows(std::get<1>(parts[i]), range.offset, range.length, 100);
    expect_rows(pair_parts[i].first, range.offset, range.length);
    EXPECT_EQ(pair_parts[i].second, 5);
  }
  EXPECT_TRUE(at::equal(std::get<1>(d9d::merge_batches(parts)), std::get<1>(batch)));
}

TEST(Core_BatchTree_MapOfNamedTensors, EachMicrobatchHoldsExactlyItsRows) {
  const std::map<std::string, at::Tensor> batch = {{"x", rows(kRows)}, {"y", rows(kRows, 2, 50)}};
  const auto parts = d9d::split_batch(batch, kParts);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i].at("x"), range.offset, range.length);
    expect_rows(parts[i].at("y"), range.offset, range.length, 50);
  }
  EXPECT_TRUE(at::equal(d9d::merge_batches(parts).at("y"), batch.at("y")));
}

TEST(Core_BatchTree_PlainAggregate, EachMicrobatchHoldsExactlyItsRows) {
  const Plain batch{.features = rows(kRows), .labels = rows(kRows, 1, 20).squeeze(1)};
  const auto parts = d9d::split_batch(batch, kParts);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i].features, range.offset, range.length);
    expect_rows(parts[i].labels, range.offset, range.length, 20);
    EXPECT_EQ(parts[i].step, 7);  // other leaves are copied
    EXPECT_EQ(parts[i].name, "plain");
  }
  const Plain back = d9d::merge_batches(parts);
  EXPECT_TRUE(at::equal(back.features, batch.features));
  EXPECT_TRUE(at::equal(back.labels, batch.labels));
}

TEST(Core_BatchTree_NestedAggregate, EachMicrobatchHoldsExactlyItsRowsAndPathsArePositions) {
  const Nested batch{.inner = {.features = rows(kRows), .labels = rows(kRows, 1, 20).squeeze(1)},
                     .extra = {{"w", rows(kRows, 2, 40)}},
                     .mask = rows(kRows, 4, 60)};
  std::vector<std::string> paths;
  // Replicate the mask (path "2"), split the rest; record the paths the spec is asked about.
  const auto spec = [&paths](std::string_view path) -> d9d::LeafSpec {
    paths.emplace_back(path);
    return path == "2" ? d9d::LeafSpec{d9d::ReplicateLeaf{}} : d9d::LeafSpec{d9d::ShardAlong{0}};
  };
  const auto parts = d9d::split_batch(batch, kParts, spec);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i].inner.features, range.offset, range.length);
    expect_rows(parts[i].inner.labels, range.offset, range.length, 20);
    expect_rows(parts[i].extra.at("w"), range.offset, range.length, 40);
    ASSERT_TRUE(parts[i].mask.has_value());
    EXPECT_TRUE(at::equal(*parts[i].mask, *batch.mask));
  }
  EXPECT_EQ(paths[0], "0.0");
  EXPECT_EQ(paths[1], "0.1");
  EXPECT_EQ(paths[2], "1{w}");
  EXPECT_EQ(paths[3], "2");
}

TEST(Core_BatchTree_HanaStruct, EachMicrobatchHoldsExactlyItsRows) {
  const Named batch{.ids = rows(kRows), .step = 3};
  const auto parts = d9d::split_batch(batch, kParts, [](std::string_view path) -> d9d::LeafSpec {
    EXPECT_EQ(path, "ids");  // adapted members keep their names
    return d9d::ShardAlong{0};
  });
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i].ids, range.offset, range.length);
    EXPECT_EQ(parts[i].step, 3);
  }
}

TEST(Core_BatchTree_Array, EachMicrobatchHoldsExactlyItsRows) {
  const std::array<at::Tensor, 2> batch = {rows(kRows), rows(kRows, 2, 30)};
  const auto parts = d9d::split_batch(batch, kParts);
  for (int i = 0; i < kParts; ++i) {
    const auto range = d9d::split_range(kRows, kParts, i);
    expect_rows(parts[i][0], range.offset, range.length);
    expect_rows(parts[i][1], range.offset, range.length, 30);
  }
}

// CUDA graphs keep one microbatch's tensors and copy the next ones into them: the copy reaches
// every tensor leaf in place, and batches of another layout are told apart, naming the leaf.
TEST(Core_BatchTree_Copy, CopiesEveryTensorInPlaceAndNamesLayoutDifferences) {
  Nested a{.inner = {.features = rows(4), .labels = rows(4, 1)},
           .extra = {{"w", rows(4, 2)}},
           .mask = rows(4, 5)};
  Nested b{.inner = {.features = rows(4, 3, 100), .labels = rows(4, 1, 200)},
           .extra = {{"w", rows(4, 2, 300)}},
           .mask = rows(4, 5, 400)};
  EXPECT_EQ(d9d::batch_layout_difference(a, b), "");
  const void* features = a.inner.features.data_ptr();
  d9d::copy_batch_(a, b);
  EXPECT_EQ(a.inner.features.data_ptr(), features);  // in place: the captured memory stays
  EXPECT_TRUE(at::equal(a.inner.features, b.inner.features));
  EXPECT_TRUE(at::equal(a.inner.labels, b.inner.labels));
  EXPECT_TRUE(at::equal(a.extra.at("w"), b.extra.at("w")));
  EXPECT_TRUE(at::equal(*a.mask, *b.mask));
  EXPECT_FALSE(a.inner.features.is_same(b.inner.features));

  auto shorter = b;
  shorter.inner.labels = rows(3, 1);
  EXPECT_EQ(d9d::batch_layout_difference(a, shorter),
            "\"0.1\" has sizes [4, 1] Long against [3, 1] Long");
  auto other_dtype = b;
  other_dtype.extra["w"] = rows(4, 2).to(at::kFloat);
  EXPECT_NE(d9d::batch_layout_difference(a, other_dtype).find("\"1{w}\""), std::string::npos);
  auto other_key = b;
  other_key.extra = {{"v", rows(4, 2)}};
  EXPECT_EQ(d9d::batch_layout_difference(a, other_key), "\"1\" has key \"w\" in one batch only");
  auto no_mask = b;
  no_mask.mask.reset();
  EXPECT_EQ(d9d::batch_layout_difference(a, no_mask), "\"2\" is set in one batch only");
  auto other_value = b;
  other_value.inner.step = 8;  // a value the task may read on the host: a graph would keep 7
  EXPECT_EQ(d9d::batch_layout_difference(a, other_value),
            "\"0.2\" differs (a value that is not a tensor)");
  // Nothing is copied when the layouts differ.
  const auto before = a.inner.features.clone();
  EXPECT_THROW(d9d::copy_batch_(a, shorter), std::invalid_argument);
  EXPECT_TRUE(at::equal(a.inner.features, before));

  Named x{.ids = rows(2), .step = 1};
  Named y{.ids = rows(2, 3, 5), .step = 1};
  d9d::copy_batch_(x, y);
  EXPECT_TRUE(at::equal(x.ids, y.ids));
  std::vector<at::Tensor> u = {rows(2)};
  std::vector<at::Tensor> v = {rows(2), rows(2)};
  EXPECT_EQ(d9d::batch_layout_difference(u, v), "\"(the batch)\" has 1 elements against 2");
}

}  // namespace
