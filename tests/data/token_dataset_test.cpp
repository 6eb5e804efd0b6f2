// Tests of d9d/data/token_dataset.hpp: windows of seq_len + 1, file boundaries, both widths, the
// vocabulary bound, and every documented error.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/data/token_dataset.hpp>

#include "tests/data/data_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::error_of;

using d9d::data::TokenDataset;
using d9d::data::TokenWidth;
using data_test::iota_ids;
using data_test::raw_tokens;
using data_test::scratch_dir;
using data_test::write_file;
using ::testing::HasSubstr;

std::vector<int64_t> values(const at::Tensor& t) {
  const at::Tensor flat = t.contiguous().view(-1);
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

std::vector<int64_t> range(int64_t first, int64_t count) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < count; ++i) {
    out.push_back(first + i);
  }
  return out;
}

TEST(Data_TokenDataset_u16, SamplesAreWindowsOfSeqLenPlusOne) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 23), 2));  // 23 tokens
  const auto ds = TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 4);
  EXPECT_EQ(ds.size(), 5);  // floor((23 - 1) / 4)
  EXPECT_EQ(ds.seq_len(), 4);
  EXPECT_EQ(ds.num_tokens(), 23);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const at::Tensor sample = ds.sample(i);
    EXPECT_EQ(sample.scalar_type(), at::kLong);
    EXPECT_EQ(sample.sizes(), at::IntArrayRef({5}));
    EXPECT_EQ(values(sample), range(4 * i, 5)) << "sample " << i;
  }
}

TEST(Data_TokenDataset_u16, TokensAreLittleEndian) {
  const std::string dir = scratch_dir();
  write_file(dir + "/le.bin", std::string("\x01\x02\xff\xff\x00\x80", 6));
  const auto ds = TokenDataset::open({dir + "/le.bin"}, TokenWidth::u16, 2);
  EXPECT_EQ(values(ds.sample(0)), (std::vector<int64_t>{0x0201, 0xFFFF, 0x8000}));
}

TEST(Data_TokenDataset_u32, ReadsIdsAbove65535) {
  const std::string dir = scratch_dir();
  write_file(dir + "/big.bin", raw_tokens(iota_ids(70000, 9), 4));
  const auto ds = TokenDataset::open({dir + "/big.bin"}, TokenWidth::u32, 4);
  ASSERT_EQ(ds.size(), 2);
  EXPECT_EQ(values(ds.sample(1)), range(70004, 5));
  EXPECT_EQ(ds.vocab_bound(), 70009);
}

TEST(Data_TokenDataset_u16_two_files, WindowsNeverCrossFiles) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 10), 2));    // 2 samples, 1 token of tail
  write_file(dir + "/b.bin", raw_tokens(iota_ids(100, 13), 2));  // 3 samples, no tail
  const auto ds = TokenDataset::open({dir + "/a.bin", dir + "/b.bin"}, TokenWidth::u16, 4);
  ASSERT_EQ(ds.size(), 5);
  EXPECT_EQ(values(ds.sample(1)), range(4, 5));
  EXPECT_EQ(values(ds.sample(2)), range(100, 5));  // b starts a fresh window
  EXPECT_EQ(values(ds.sample(4)), range(108, 5));
  EXPECT_EQ(ds.paths().size(), 2U);
}

TEST(Data_TokenDataset_u16, BatchStacksSamplesInTheOrderAsked) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 31), 2));
  const auto ds = TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 3);
  const at::Tensor batch = ds.batch({9, 0, 4});
  EXPECT_EQ(batch.sizes(), at::IntArrayRef({3, 4}));
  EXPECT_EQ(values(batch[0]), range(27, 4));
  EXPECT_EQ(values(batch[1]), range(0, 4));
  EXPECT_EQ(values(batch[2]), range(12, 4));
  EXPECT_EQ(ds.batch({}).sizes(), at::IntArrayRef({0, 4}));
}

TEST(Data_TokenDataset_u16, VocabBoundCountsEveryTokenIncludingTails) {
  const std::string dir = scratch_dir();
  std::vector<uint32_t> ids = iota_ids(0, 9);
  ids.push_back(500);  // the tail: in no sample (10 tokens, seq_len 4 -> 2 samples)
  write_file(dir + "/a.bin", raw_tokens(ids, 2));
  const auto ds = TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 4);
  EXPECT_EQ(ds.size(), 2);
  EXPECT_EQ(ds.vocab_bound(), 501);
  EXPECT_EQ(ds.vocab_bound(), 501);  // cached
}

TEST(Data_TokenDataset, CheckVocabNamesTheFirstIdBeyondTheVocabulary) {
  const std::string dir = scratch_dir();
  write_file(dir + "/low.bin", raw_tokens(iota_ids(0, 9), 4));
  std::vector<uint32_t> ids = iota_ids(0, 9);
  ids[6] = 70000;  // beyond u16: read as u32
  ids[8] = 258;
  write_file(dir + "/high.bin", raw_tokens(ids, 4));
  const auto ds = TokenDataset::open({dir + "/low.bin", dir + "/high.bin"}, TokenWidth::u32, 4);
  ds.check_vocab(70001);  // every id is below
  const auto error = error_of<std::runtime_error>([&] { ds.check_vocab(258); });
  EXPECT_THAT(error, HasSubstr(dir + "/high.bin: token 6 is id 70000, not below the model's "
                                     "vocabulary size 258 (the files' largest id is 70000"))
      << error;
  // The first file alone is fine up to its largest id, 8.
  const auto low = TokenDataset::open({dir + "/low.bin"}, TokenWidth::u32, 4);
  low.check_vocab(9);
  EXPECT_THAT(error_of<std::runtime_error>([&] { low.check_vocab(8); }),
              HasSubstr("low.bin: token 8 is id 8, not below the model's vocabulary size 8"));
}

TEST(Data_TokenDataset_u16, CopiesShareTheMappingAndOutliveTheOriginal) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 9), 2));
  std::optional<TokenDataset> original = TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 4);
  const TokenDataset copy = *original;
  original.reset();
  EXPECT_EQ(values(copy.sample(1)), range(4, 5));
}

// ------------------------------------------------------------------------------------------------
// Errors name the file and the problem

TEST(Data_TokenDataset_Errors, MissingFile) {
  const std::string dir = scratch_dir();
  EXPECT_THAT(error_of<std::runtime_error>(
                  [&] { (void)TokenDataset::open({dir + "/nope.bin"}, TokenWidth::u16, 4); }),
              HasSubstr(dir + "/nope.bin: cannot open (No such file or directory)"));
}

TEST(Data_TokenDataset_Errors, SizeNotAMultipleOfTheWidth) {
  const std::string dir = scratch_dir();
  write_file(dir + "/odd.bin", std::string(21, '\1'));
  EXPECT_THAT(error_of<std::runtime_error>(
                  [&] { (void)TokenDataset::open({dir + "/odd.bin"}, TokenWidth::u16, 4); }),
              HasSubstr("odd.bin: 21 bytes is not a multiple of the token width 2 (u16)"));
  write_file(dir + "/odd4.bin", std::string(22, '\1'));
  EXPECT_THAT(error_of<std::runtime_error>(
                  [&] { (void)TokenDataset::open({dir + "/odd4.bin"}, TokenWidth::u32, 4); }),
              HasSubstr("odd4.bin: 22 bytes is not a multiple of the token width 4 (u32)"));
}

TEST(Data_TokenDataset_Errors, TooFewTokensForOneSample) {
  const std::string dir = scratch_dir();
  write_file(dir + "/ok.bin", raw_tokens(iota_ids(0, 20), 2));
  write_file(dir + "/short.bin", raw_tokens(iota_ids(0, 4), 2));
  write_file(dir + "/empty.bin", "");
  EXPECT_THAT(error_of<std::runtime_error>([&] {
                (void)TokenDataset::open({dir + "/ok.bin", dir + "/short.bin"}, TokenWidth::u16, 4);
              }),
              HasSubstr("short.bin: too few tokens for one sample (4 tokens; seq_len 4 needs 5)"));
  EXPECT_THAT(error_of<std::runtime_error>(
                  [&] { (void)TokenDataset::open({dir + "/empty.bin"}, TokenWidth::u16, 4); }),
              HasSubstr("empty.bin: too few tokens for one sample (0 tokens"));
}

TEST(Data_TokenDataset_Errors, BadArguments) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 20), 2));
  EXPECT_THAT(error_of<std::invalid_argument>(
                  [&] { (void)TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 0); }),
              HasSubstr("seq_len must be >= 1 (got 0)"));
  EXPECT_THAT(
      error_of<std::invalid_argument>([&] { (void)TokenDataset::open({}, TokenWidth::u16, 4); }),
      HasSubstr("no files given"));
  EXPECT_THAT(
      error_of<std::runtime_error>([&] { (void)TokenDataset::open({dir}, TokenWidth::u16, 4); }),
      HasSubstr(dir + ": not a regular file"));
}

TEST(Data_TokenDataset_Errors, IndexOutOfRange) {
  const std::string dir = scratch_dir();
  write_file(dir + "/a.bin", raw_tokens(iota_ids(0, 20), 2));
  const auto ds = TokenDataset::open({dir + "/a.bin"}, TokenWidth::u16, 4);  // 4 samples
  EXPECT_THAT(error_of<std::invalid_argument>([&] { (void)ds.sample(4); }),
              HasSubstr("sample index 4 is out of range [0, 4)"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] { (void)ds.sample(-1); }),
              HasSubstr("sample index -1 is out of range [0, 4)"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)ds.batch({0, 9});
              }),
              HasSubstr("sample index 9 is out of range [0, 4)"));
}

}  // namespace
