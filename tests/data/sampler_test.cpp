// Tests of d9d/data/sampler.hpp: the pinned shuffle, disjoint equal shares on 1/2/4/8 ranks,
// epochs and steps.
#include <algorithm>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/data/sampler.hpp>

namespace {

using d9d::data::DistributedSampler;
using d9d::data::epoch_order;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ------------------------------------------------------------------------------------------------
// The generator and the order are pinned: the same on every platform, forever (changing them
// changes which data a resumed run reads).

TEST(Data_Sampler_Rng, SplitMix64MatchesItsPublishedFirstOutput) {
  uint64_t state = 0;
  EXPECT_EQ(d9d::data::detail::splitmix64(state), 0xE220A8397B1DCDAFULL);
}

TEST(Data_Sampler_Rng, Xoshiro256MatchesAnIndependentImplementation) {
  // Values from a Python transcription of splitmix64 + xoshiro256** (seed 0).
  d9d::data::detail::Xoshiro256 rng(0);
  EXPECT_EQ(rng.next(), 0x99EC5F36CB75F2B4ULL);
  EXPECT_EQ(rng.next(), 0xBF6E1F784956452AULL);
  EXPECT_EQ(rng.next(), 0x1A5F849D4933E6E0ULL);
}

TEST(Data_Sampler_Order, ShuffleIsPinned) {
  // Fisher–Yates from the last position down, j = below(i + 1), seeded with seed + epoch.
  EXPECT_THAT(epoch_order(10, 42, 0), ElementsAre(7, 3, 8, 9, 5, 6, 4, 1, 0, 2));
  EXPECT_THAT(epoch_order(10, 42, 1), ElementsAre(2, 1, 3, 9, 5, 6, 4, 7, 0, 8));
  EXPECT_THAT(epoch_order(16, 7, 3),
              ElementsAre(0, 4, 5, 11, 7, 15, 8, 9, 12, 10, 3, 1, 6, 14, 2, 13));
  EXPECT_THAT(epoch_order(5, 42, 0, /*shuffle=*/false), ElementsAre(0, 1, 2, 3, 4));
}

TEST(Data_Sampler_Order, IsAPermutation) {
  for (const int64_t n : {1, 2, 3, 17, 1000}) {
    auto order = epoch_order(n, 123, 5);
    std::sort(order.begin(), order.end());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(order[static_cast<std::size_t>(i)], i) << "n = " << n;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Shares over dp ranks

class Data_DistributedSampler : public ::testing::TestWithParam<std::tuple<int, int64_t>> {
 protected:
  static std::vector<DistributedSampler> all_ranks(int dp, int64_t n, uint64_t seed,
                                                   bool drop_last = true) {
    std::vector<DistributedSampler> ranks;
    ranks.reserve(static_cast<std::size_t>(dp));
    for (int r = 0; r < dp; ++r) {
      ranks.emplace_back(d9d::data::SamplerOptions{
          .num_samples = n, .dp_rank = r, .dp_size = dp, .seed = seed, .drop_last = drop_last});
    }
    return ranks;
  }
};

TEST_P(Data_DistributedSampler, RanksAreDisjointAndCoverAllButTheRemainder) {
  const auto [dp, n] = GetParam();
  for (const int64_t epoch : {0, 1, 7}) {
    std::set<int64_t> seen;
    for (const auto& rank : all_ranks(dp, n, 2024)) {
      const auto share = rank.indices(epoch);
      ASSERT_EQ(static_cast<int64_t>(share.size()), n / dp);
      for (const int64_t index : share) {
        ASSERT_GE(index, 0);
        ASSERT_LT(index, n);
        ASSERT_TRUE(seen.insert(index).second) << "index " << index << " on two ranks";
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), n - n % dp);
    // The dropped ones are the tail of the epoch's order.
    const auto order = epoch_order(n, 2024, epoch);
    for (int64_t k = n - n % dp; k < n; ++k) {
      EXPECT_EQ(seen.count(order[static_cast<std::size_t>(k)]), 0U);
    }
  }
}

TEST_P(Data_DistributedSampler, SameSeedSameOrderOtherEpochOrSeedOtherOrder) {
  const auto [dp, n] = GetParam();
  const auto a = all_ranks(dp, n, 99);
  const auto b = all_ranks(dp, n, 99);
  const auto c = all_ranks(dp, n, 100);
  for (int r = 0; r < dp; ++r) {
    const auto& mine = a[static_cast<std::size_t>(r)];
    EXPECT_EQ(mine.indices(3), b[static_cast<std::size_t>(r)].indices(3));
  }
  // Compare the whole epoch (all ranks): a single rank's share can be short.
  const auto gather = [&](const std::vector<DistributedSampler>& ranks, int64_t epoch) {
    std::vector<int64_t> all;
    for (const auto& rank : ranks) {
      const auto share = rank.indices(epoch);
      all.insert(all.end(), share.begin(), share.end());
    }
    return all;
  };
  EXPECT_NE(gather(a, 0), gather(a, 1));
  EXPECT_NE(gather(a, 0), gather(c, 0));
}

TEST_P(Data_DistributedSampler, GlobalBatchOfAStepIsASliceOfTheOrder) {
  const auto [dp, n] = GetParam();
  auto ranks = all_ranks(dp, n, 5);
  const int64_t b = 2;
  const int64_t steps = ranks[0].steps_per_epoch(b);
  ASSERT_EQ(steps, (n / dp) / b);
  for (const int64_t step : {int64_t{0}, steps - 1, steps, 3 * steps + 1}) {
    const int64_t epoch = step / steps;
    const int64_t within = step % steps;
    EXPECT_EQ(ranks[0].epoch_of(step, b), epoch);
    std::vector<int64_t> global;
    for (auto& rank : ranks) {
      const auto mine = rank.batch(step, b);
      ASSERT_EQ(static_cast<int64_t>(mine.size()), b);
      global.insert(global.end(), mine.begin(), mine.end());
    }
    const auto order = epoch_order(n, 5, epoch);
    std::vector<int64_t> slice(order.begin() + within * b * dp,
                               order.begin() + (within + 1) * b * dp);
    std::sort(global.begin(), global.end());
    std::sort(slice.begin(), slice.end());
    EXPECT_EQ(global, slice) << "step " << step;
  }
}

TEST_P(Data_DistributedSampler, StepsWalkTheEpochsInOrder) {
  const auto [dp, n] = GetParam();
  auto rank = all_ranks(dp, n, 11).back();
  const int64_t b = 3;
  const int64_t steps = rank.steps_per_epoch(b);
  for (const int64_t epoch : {0, 1, 2}) {
    const auto share = rank.indices(epoch);
    for (int64_t s = 0; s < steps; ++s) {
      const auto mine = rank.batch(epoch * steps + s, b);
      EXPECT_TRUE(std::equal(mine.begin(), mine.end(), share.begin() + s * b));
    }
  }
}

TEST_P(Data_DistributedSampler, WithoutDropLastEverySampleIsReadAndSharesStayEqual) {
  const auto [dp, n] = GetParam();
  std::set<int64_t> seen;
  const int64_t per_rank = (n + dp - 1) / dp;
  for (const auto& rank : all_ranks(dp, n, 3, /*drop_last=*/false)) {
    const auto share = rank.indices(0);
    ASSERT_EQ(static_cast<int64_t>(share.size()), per_rank);
    seen.insert(share.begin(), share.end());
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
}

std::string sampler_case_name(const ::testing::TestParamInfo<std::tuple<int, int64_t>>& info) {
  return "dp" + std::to_string(std::get<0>(info.param)) + "_n" +
         std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Ranks, Data_DistributedSampler,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(int64_t{37}, int64_t{64},
                                                              int64_t{1001})),
                         sampler_case_name);

TEST(Data_DistributedSampler_dp4, UnshuffledSharesAreStrided) {
  const DistributedSampler rank1({.num_samples = 10, .dp_rank = 1, .dp_size = 4, .shuffle = false});
  EXPECT_THAT(rank1.indices(0), ElementsAre(1, 5));
  EXPECT_EQ(rank1.dropped_per_epoch(), 2);
  const DistributedSampler padded(
      {.num_samples = 10, .dp_rank = 3, .dp_size = 4, .shuffle = false, .drop_last = false});
  EXPECT_THAT(padded.indices(0), ElementsAre(3, 7, 1));  // position 11 wraps to the order's 1
}

std::string error_of(const d9d::data::SamplerOptions& options) {
  try {
    const DistributedSampler sampler(options);
    (void)sampler.steps_per_epoch(100);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

TEST(Data_DistributedSampler_Errors, NameTheFieldAndTheValue) {
  EXPECT_THAT(error_of({.num_samples = 10, .dp_rank = 4, .dp_size = 4}),
              HasSubstr("dp_rank must be in [0, dp_size) (got 4 with dp_size 4)"));
  EXPECT_THAT(error_of({.num_samples = 10, .dp_rank = 0, .dp_size = 0}),
              HasSubstr("dp_size must be >= 1 (got 0)"));
  EXPECT_THAT(error_of({.num_samples = 0}), HasSubstr("num_samples must be >= 1 (got 0)"));
  EXPECT_THAT(error_of({.num_samples = 3, .dp_rank = 0, .dp_size = 4}),
              HasSubstr("num_samples (3) < dp_size (4)"));
  EXPECT_THAT(error_of({.num_samples = 40, .dp_rank = 0, .dp_size = 4}),
              HasSubstr("batch_size_per_rank (100) exceeds the samples per rank and epoch (10)"));
}

}  // namespace
