// TFRecord framing and CRC32C against published vectors and bytes from an independent writer.
#include <string>

#include <gtest/gtest.h>

#include <d9d/track/tfrecord.hpp>

#include "tests/track/track_test_util.hpp"

namespace {

using track_test::from_hex;

TEST(Track_Crc32c, KnownVectors) {
  EXPECT_EQ(d9d::track::crc32c(""), 0x00000000U);
  EXPECT_EQ(d9d::track::crc32c("123456789"), 0xE3069283U);
  // The iSCSI test patterns (RFC 3720, B.4): 32 zero bytes, 32 0xFF bytes, bytes 0..31.
  EXPECT_EQ(d9d::track::crc32c(std::string(32, '\0')), 0x8A9136AAU);
  EXPECT_EQ(d9d::track::crc32c(std::string(32, '\xFF')), 0x62A8AB43U);
  std::string ascending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
  }
  EXPECT_EQ(d9d::track::crc32c(ascending), 0x46DD794EU);
}

TEST(Track_Crc32c, MaskRotatesAndAddsConstant) {
  const std::uint32_t crc = d9d::track::crc32c("123456789");
  EXPECT_EQ(d9d::track::masked_crc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xa282ead8U);
}

TEST(Track_TfRecord, FramesSmallRecord) {
  // Bytes of the record "abc" as TensorBoard's own Python TFRecord code writes it.
  EXPECT_EQ(d9d::track::tfrecord_frame("abc"),
            from_hex("03 00 00 00 00 00 00 00  b0 99 49 0e  61 62 63  6e 57 f1 21"));
}

TEST(Track_TfRecord, LengthIsLittleEndianUint64) {
  const std::string payload(300, 'x');
  const std::string record = d9d::track::tfrecord_frame(payload);
  ASSERT_EQ(record.size(), 316U);
  EXPECT_EQ(record.substr(0, 8), from_hex("2c 01 00 00 00 00 00 00"));
  EXPECT_EQ(track_test::read_records(record), std::vector<std::string>{payload});
}

}  // namespace
