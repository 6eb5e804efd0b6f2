// TFRecord framing and CRC32C (table-driven, reflected Castagnoli polynomial).
#include <array>

#include <d9d/track/tfrecord.hpp>

namespace d9d::track {

namespace {

constexpr std::uint32_t kCastagnoliReflected = 0x82F63B78U;
constexpr std::uint32_t kMaskDelta = 0xa282ead8U;

constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t byte = 0; byte < 256; ++byte) {
    std::uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 1U) != 0 ? (crc >> 1) ^ kCastagnoliReflected : crc >> 1;
    }
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kCrcTable = make_crc_table();

void append_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFU));
  }
}

}  // namespace

std::uint32_t crc32c(std::string_view data) {
  std::uint32_t crc = 0xFFFFFFFFU;
  for (const char c : data) {
    crc = kCrcTable[(crc ^ static_cast<unsigned char>(c)) & 0xFFU] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFU;
}

std::uint32_t masked_crc32c(std::string_view data) {
  const std::uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

std::string tfrecord_frame(std::string_view payload) {
  std::string record;
  record.reserve(payload.size() + 16);
  append_le(record, payload.size(), 8);
  append_le(record, masked_crc32c(record), 4);
  record.append(payload);
  append_le(record, masked_crc32c(payload), 4);
  return record;
}

}  // namespace d9d::track
