// Tests of tools/tokenize: text files through the tool and back through TokenDataset, exact ids.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/data/byte_tokenizer.hpp>
#include <d9d/data/token_dataset.hpp>
#include <d9d/util/files.hpp>

#include "tests/data/data_test_util.hpp"
#include "tests/support/subprocess.hpp"

namespace {

using d9d::data::TokenDataset;
using d9d::data::TokenWidth;
using data_test::read_file;
using data_test::scratch_dir;
using data_test::write_file;
using ::testing::HasSubstr;

constexpr int64_t kEot = d9d::data::ByteTokenizer::end_of_text;

// Runs the tool (its path comes from the BUILD file's env) with `args`; stdout and stderr joined.
d9d::testing::CommandRun tokenize(const std::string& args) {
  const char* tool = std::getenv("D9D_TOKENIZE");
  if (tool == nullptr) {
    ADD_FAILURE() << "D9D_TOKENIZE is not set; run this test through Bazel (tests/data/BUILD)";
    return {};
  }
  return d9d::testing::run_command(std::string(tool) + " " + args + " 2>&1");
}

// Three small documents: ASCII, NUL and 0xff bytes, a line of text.
std::string three_documents(const std::string& dir) {
  write_file(dir + "/a.txt", "ab");
  write_file(dir + "/b.txt", std::string("\x00\xff", 2));
  write_file(dir + "/c.txt", "hello\n");
  return dir + "/a.txt " + dir + "/b.txt " + dir + "/c.txt";
}

// The tokens of three_documents(), each document followed by <|endoftext|>.
std::vector<int64_t> stream() {
  return {'a', 'b', kEot, 0, 255, kEot, 'h', 'e', 'l', 'l', 'o', '\n', kEot};
}

std::vector<int64_t> values(const at::Tensor& t) {
  const at::Tensor flat = t.contiguous().view(-1);
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

TEST(Data_TokenizeTool_u16, TokenizedFilesReadBackExactly) {
  const std::string dir = scratch_dir();
  const auto run = tokenize("--out " + dir + "/corpus.bin " + three_documents(dir));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("3 documents, 10 bytes -> 13 tokens"));
  EXPECT_THAT(run.output, HasSubstr("b.txt: 3 tokens"));
  EXPECT_EQ(read_file(dir + "/corpus.bin").size(), 26U);  // 13 tokens of 2 bytes

  const auto all = stream();
  const auto ds = TokenDataset::open({dir + "/corpus.bin"}, TokenWidth::u16, 3);
  ASSERT_EQ(ds.size(), 4);  // floor((13 - 1) / 3)
  for (int64_t i = 0; i < ds.size(); ++i) {
    const std::vector<int64_t> expected(all.begin() + 3 * i, all.begin() + 3 * i + 4);
    EXPECT_EQ(values(ds.sample(i)), expected) << "sample " << i;
  }
  EXPECT_EQ(ds.vocab_bound(), kEot + 1);
}

TEST(Data_TokenizeTool_u32_val, ValidationGetsTheLastFractionOfTheStream) {
  const std::string dir = scratch_dir();
  const auto run = tokenize("--out " + dir + "/train.bin --width u32 --val-out " + dir +
                            "/val.bin --val-fraction 0.25 " + three_documents(dir));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("train.bin: 10 tokens"));  // 13 - round(0.25 * 13)
  EXPECT_THAT(run.output, HasSubstr("val.bin: 3 tokens"));

  const auto all = stream();
  const auto train = TokenDataset::open({dir + "/train.bin"}, TokenWidth::u32, 9);
  ASSERT_EQ(train.size(), 1);
  EXPECT_EQ(values(train.sample(0)), std::vector<int64_t>(all.begin(), all.begin() + 10));
  const auto val = TokenDataset::open({dir + "/val.bin"}, TokenWidth::u32, 2);
  ASSERT_EQ(val.size(), 1);
  EXPECT_EQ(values(val.sample(0)), std::vector<int64_t>(all.begin() + 10, all.end()));
}

TEST(Data_TokenizeTool, BadInputsFailWithAMessage) {
  const std::string dir = scratch_dir();
  auto run = tokenize("--out " + dir + "/x.bin " + dir + "/missing.txt");
  EXPECT_NE(run.status, 0);
  EXPECT_THAT(run.output, HasSubstr("missing.txt"));
  write_file(dir + "/a.txt", "ab");
  run = tokenize("--out " + dir + "/x.bin --width u8 " + dir + "/a.txt");
  EXPECT_NE(run.status, 0);
  EXPECT_THAT(run.output, HasSubstr("--width"));
  run = tokenize("--out " + dir + "/x.bin --val-out " + dir + "/v.bin --val-fraction 0.01 " + dir +
                 "/a.txt");
  EXPECT_NE(run.status, 0);
  EXPECT_THAT(run.output, HasSubstr("leaves one of the two files empty"));
  EXPECT_FALSE(d9d::files::exists(dir + "/x.bin"));  // nothing written, no .tmp left
  EXPECT_FALSE(d9d::files::exists(dir + "/x.bin.tmp"));
}

}  // namespace
