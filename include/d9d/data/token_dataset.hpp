// d9d/data/token_dataset.hpp — fixed-length training samples from pre-tokenised binary files.
//
//   auto ds = d9d::data::TokenDataset::open({"corpus.bin"}, d9d::data::TokenWidth::u16, 256);
//   at::Tensor one = ds.sample(0);                 // int64 [257]: inputs one[:-1], labels one[1:]
//   at::Tensor many = ds.batch({4, 9, 2});         // int64 [3, 257]
//
// A file is the raw format tokenisation scripts write: a flat array of little-endian uint16 or
// uint32 token ids, no header (tools/tokenize writes it). Files are memory-mapped read-only at
// open (POSIX mmap); nothing is copied until a sample is asked for, and the OS pages data in and
// out as needed. A file must not be truncated or rewritten while a dataset maps it (reading a
// vanished page raises SIGBUS).
//
// Samples are non-overlapping windows of seq_len + 1 tokens, so inputs and next-token labels come
// from one sample: a file of t tokens contributes floor((t - 1) / seq_len) samples, its sample j
// covering its tokens [j * seq_len, j * seq_len + seq_len + 1) (consecutive windows share one
// boundary token, the last label of one being the first input of the next). Windows never cross a
// file; samples are numbered file after file, in the order of `paths`. The tail of a file that
// does not fill a window is never read as a sample.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::data {

/// Bytes per token id in a raw token file.
enum class TokenWidth : uint8_t { u16 = 2, u32 = 4 };

/// "u16" / "u32".
[[nodiscard]] const char* to_string(TokenWidth width);

/// A read-only view of token files as fixed-length samples (see the file comment). Copies share
/// the mappings; every method is const and safe to call from several threads.
class TokenDataset {
 public:
  /// Maps `paths` (in this order). std::invalid_argument for no paths or seq_len < 1;
  /// std::runtime_error naming the file for a missing/unreadable file, a size that is not a
  /// multiple of the token width, or fewer than seq_len + 1 tokens (no sample).
  [[nodiscard]] static TokenDataset open(std::vector<std::string> paths, TokenWidth width,
                                         int64_t seq_len);

  /// Number of samples over all files.
  [[nodiscard]] int64_t size() const;
  [[nodiscard]] int64_t seq_len() const;
  [[nodiscard]] TokenWidth width() const;
  /// Tokens in all files, including tails that fill no window.
  [[nodiscard]] int64_t num_tokens() const;
  [[nodiscard]] const std::vector<std::string>& paths() const;

  /// Sample `index` as int64 [seq_len + 1]; std::invalid_argument when index is not in
  /// [0, size()).
  [[nodiscard]] at::Tensor sample(int64_t index) const;
  /// The samples at `indices` as int64 [indices.size(), seq_len + 1] (rows in that order).
  [[nodiscard]] at::Tensor batch(const std::vector<int64_t>& indices) const;

  /// Largest token id in the files, plus 1 (a lower bound on the vocabulary a model needs).
  /// Cost: the first call reads every token of every file once (O(num_tokens()), pages the whole
  /// files in); the result is kept, so later calls (and copies of this dataset) are free.
  [[nodiscard]] int64_t vocab_bound() const;
  /// Checks that every token id is below `vocab_size` (reads the files as vocab_bound() does);
  /// std::runtime_error naming the first file, position and id that is not, and the fix.
  void check_vocab(int64_t vocab_size) const;

 private:
  struct State;  // the mappings (src/data/token_dataset.cpp)
  explicit TokenDataset(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace d9d::data
