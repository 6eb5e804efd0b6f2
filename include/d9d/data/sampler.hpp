// d9d/data/sampler.hpp — which samples each data-parallel rank reads, epoch after epoch.
//
//   d9d::data::DistributedSampler sampler({.num_samples = ds.size(), .dp_rank = r, .dp_size = n,
//                                          .seed = 1234});
//   at::Tensor tokens = ds.batch(sampler.batch(step, 8));   // this rank's 8 samples of `step`
//
// Each epoch has one order of all samples, the same on every rank: 0..n-1 shuffled by
// Fisher–Yates driven by xoshiro256** seeded through splitmix64 from seed + epoch (all in uint64
// arithmetic, so the order is the same on every platform and compiler; std::shuffle is not used
// because its algorithm is unspecified). shuffle = false keeps 0..n-1.
//
// Shares are strided: with n' = samples_per_rank() * dp_size, rank r takes positions r, r +
// dp_size, r + 2 dp_size, ... of the first n' entries of the order. drop_last = true (the default)
// drops the last n - n' entries (fewer than dp_size), so the shares are disjoint, equally long and
// cover all but those; drop_last = false instead pads the order by repeating it from its start up
// to a multiple of dp_size, so every sample is read and up to dp_size - 1 of them twice an epoch.
// Striding makes the global batch of a step (all ranks together) a contiguous slice of the order:
// the data of a step depends on the global batch size, not on how it is split over ranks.
//
// Steps: an epoch has steps_per_epoch(b) = floor(samples_per_rank() / b) full batches of b; the
// rest of the share (fewer than b) is skipped. Step s (counted from 0 over the whole run) is batch
// s % steps_per_epoch(b) of epoch s / steps_per_epoch(b), so a run resumes from its step alone.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace d9d::data {

/// What a DistributedSampler draws from and for whom.
struct SamplerOptions {
  int64_t num_samples = 0;
  int dp_rank = 0;
  int dp_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
};

namespace detail {

/// splitmix64: advances `state` and returns the next output (seeds xoshiro256**).
constexpr uint64_t splitmix64(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31U);
}

/// xoshiro256**: a small, fast generator with a fixed, published output sequence.
class Xoshiro256 {
 public:
  explicit constexpr Xoshiro256(uint64_t seed) {
    for (auto& word : s_) {
      word = splitmix64(seed);
    }
  }

  constexpr uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5U, 7) * 9U;
    const uint64_t t = s_[1] << 17U;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  /// Uniform in [0, bound) without modulo bias (rejection of the short last interval).
  constexpr uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) {
        return r % bound;
      }
    }
  }

 private:
  static constexpr uint64_t rotl(uint64_t x, int k) {
    return (x << static_cast<unsigned>(k)) | (x >> static_cast<unsigned>(64 - k));
  }
  uint64_t s_[4] = {};
};

}  // namespace detail

/// 0..num_samples-1, shuffled (Fisher–Yates over xoshiro256** seeded with seed + epoch) or not.
[[nodiscard]] inline std::vector<int64_t> epoch_order(int64_t num_samples, uint64_t seed,
                                                      int64_t epoch, bool shuffle = true) {
  if (num_samples < 0 || epoch < 0) {
    throw std::invalid_argument("d9d::data::epoch_order: num_samples (" +
                                std::to_string(num_samples) + ") and epoch (" +
                                std::to_string(epoch) + ") must be >= 0");
  }
  std::vector<int64_t> order(static_cast<std::size_t>(num_samples));
  for (int64_t i = 0; i < num_samples; ++i) {
    order[static_cast<std::size_t>(i)] = i;
  }
  if (shuffle) {
    detail::Xoshiro256 rng(seed + static_cast<uint64_t>(epoch));
    for (int64_t i = num_samples - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
      std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
    }
  }
  return order;
}

/// This rank's disjoint share of every epoch's order, and its batches by step (file comment).
class DistributedSampler {
 public:
  /// Checks the options (std::invalid_argument naming the field, the value and the fix).
  explicit DistributedSampler(SamplerOptions options) : options_(options) {
    const auto fail = [](const std::string& what) {
      throw std::invalid_argument("d9d::data::DistributedSampler: " + what);
    };
    if (options_.dp_size < 1) {
      fail("dp_size must be >= 1 (got " + std::to_string(options_.dp_size) + ")");
    }
    if (options_.dp_rank < 0 || options_.dp_rank >= options_.dp_size) {
      fail("dp_rank must be in [0, dp_size) (got " + std::to_string(options_.dp_rank) +
           " with dp_size " + std::to_string(options_.dp_size) + ")");
    }
    if (options_.num_samples < 1) {
      fail("num_samples must be >= 1 (got " + std::to_string(options_.num_samples) +
           "). Fix: check that the dataset is not empty");
    }
    if (options_.drop_last && options_.num_samples < options_.dp_size) {
      fail("num_samples (" + std::to_string(options_.num_samples) + ") < dp_size (" +
           std::to_string(options_.dp_size) +
           ") leaves every rank without a sample under drop_last. Fix: more data, a smaller "
           "dp_size, or .drop_last = false");
    }
  }

  [[nodiscard]] const SamplerOptions& options() const { return options_; }

  /// Length of every rank's share of one epoch.
  [[nodiscard]] int64_t samples_per_rank() const {
    const int64_t n = options_.num_samples;
    const int64_t dp = options_.dp_size;
    return options_.drop_last ? n / dp : (n + dp - 1) / dp;
  }

  /// Entries of each epoch's order that no rank reads (drop_last), else 0.
  [[nodiscard]] int64_t dropped_per_epoch() const {
    return options_.drop_last ? options_.num_samples - samples_per_rank() * options_.dp_size : 0;
  }

  /// This rank's share of epoch `epoch`, in reading order.
  [[nodiscard]] std::vector<int64_t> indices(int64_t epoch) const {
    const auto order = epoch_order(options_.num_samples, options_.seed, epoch, options_.shuffle);
    const int64_t per_rank = samples_per_rank();
    std::vector<int64_t> share;
    share.reserve(static_cast<std::size_t>(per_rank));
    for (int64_t k = 0; k < per_rank; ++k) {
      const int64_t position = k * options_.dp_size + options_.dp_rank;
      share.push_back(order[static_cast<std::size_t>(position % options_.num_samples)]);
    }
    return share;
  }

  /// Full batches of `batch_size_per_rank` in one epoch (>= 1, else std::invalid_argument).
  [[nodiscard]] int64_t steps_per_epoch(int64_t batch_size_per_rank) const {
    if (batch_size_per_rank < 1) {
      throw std::invalid_argument(
          "d9d::data::DistributedSampler: batch_size_per_rank must be >= 1"
          " (got " +
          std::to_string(batch_size_per_rank) + ")");
    }
    const int64_t steps = samples_per_rank() / batch_size_per_rank;
    if (steps == 0) {
      throw std::invalid_argument(
          "d9d::data::DistributedSampler: batch_size_per_rank (" +
          std::to_string(batch_size_per_rank) + ") exceeds the samples per rank and epoch (" +
          std::to_string(samples_per_rank()) + "). Fix: a smaller batch or more data");
    }
    return steps;
  }

  /// The epoch that step `step` falls in (see the file comment).
  [[nodiscard]] int64_t epoch_of(int64_t step, int64_t batch_size_per_rank) const {
    check_step(step);
    return step / steps_per_epoch(batch_size_per_rank);
  }

  /// This rank's sample indices for step `step` (from 0 over the whole run). Keeps the share of
  /// the last epoch it was asked for, so consecutive steps of one epoch shuffle once; hence not
  /// const, and one sampler per thread.
  [[nodiscard]] std::vector<int64_t> batch(int64_t step, int64_t batch_size_per_rank) {
    check_step(step);
    const int64_t steps = steps_per_epoch(batch_size_per_rank);
    const int64_t epoch = step / steps;
    if (cached_epoch_ != epoch) {
      cached_share_ = indices(epoch);
      cached_epoch_ = epoch;
    }
    const auto begin = cached_share_.begin() + (step % steps) * batch_size_per_rank;
    return {begin, begin + batch_size_per_rank};
  }

 private:
  static void check_step(int64_t step) {
    if (step < 0) {
      throw std::invalid_argument("d9d::data::DistributedSampler: step must be >= 0 (got " +
                                  std::to_string(step) + ")");
    }
  }

  SamplerOptions options_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_share_;
};

}  // namespace d9d::data
