// Tests of d9d/data/byte_tokenizer.hpp: ids, specials, lossless round trips.
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/data/byte_tokenizer.hpp>

namespace {

using d9d::data::ByteTokenizer;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Data_ByteTokenizer, VocabIsBytesThenEndOfTextThenPad) {
  EXPECT_EQ(ByteTokenizer::vocab_size(), 258U);
  EXPECT_EQ(ByteTokenizer::end_of_text, 256U);
  EXPECT_EQ(ByteTokenizer::pad, 257U);
  EXPECT_EQ(ByteTokenizer::special_name(256), "<|endoftext|>");
  EXPECT_EQ(ByteTokenizer::special_name(257), "<|pad|>");
  EXPECT_EQ(ByteTokenizer::special_name(65), "");
  EXPECT_FALSE(ByteTokenizer::is_special(255));
  EXPECT_TRUE(ByteTokenizer::is_special(256));
  EXPECT_FALSE(ByteTokenizer::is_special(258));
}

TEST(Data_ByteTokenizer, EncodesEachByteAsItsValue) {
  const ByteTokenizer tok;
  EXPECT_THAT(tok.encode("hi"), ElementsAre(104, 105));
  EXPECT_THAT(tok.encode(std::string("\x00\xff\x80", 3)), ElementsAre(0, 255, 128));
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Data_ByteTokenizer, RoundTripsEveryByteIncludingNulAndInvalidUtf8) {
  const ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) {
    all.push_back(static_cast<char>(b));
  }
  all += std::string("\xc3\x28\xa0\xa1\xf0\x28\x8c\xbc\x00\x00", 10);  // invalid UTF-8, NULs
  all += "caf\xc3\xa9";                                                // valid UTF-8
  EXPECT_EQ(tok.encode(all).size(), all.size());
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
}

TEST(Data_ByteTokenizer, SpecialsDecodeToTheirNames) {
  const ByteTokenizer tok;
  std::vector<uint32_t> ids = tok.encode("hi");
  ids.push_back(ByteTokenizer::end_of_text);
  ids.push_back(ByteTokenizer::pad);
  EXPECT_EQ(tok.decode(ids), "hi<|endoftext|><|pad|>");
}

TEST(Data_ByteTokenizer, TextOfASpecialStaysBytes) {
  const ByteTokenizer tok;
  const auto ids = tok.encode("<|endoftext|>");
  EXPECT_EQ(ids.size(), 13U);
  for (const uint32_t id : ids) {
    EXPECT_LT(id, 256U);
  }
}

TEST(Data_ByteTokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  const ByteTokenizer tok;
  const std::vector<uint32_t> ids = {104, 258};
  try {
    (void)tok.decode(ids);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("id 258 at position 1 is outside the vocabulary"));
  }
}

}  // namespace
