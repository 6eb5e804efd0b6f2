// d9d/track/tfrecord.hpp — TFRecord framing: the container format of TensorBoard event files.
//
//   std::string record = d9d::track::tfrecord_frame(payload);   // length, CRCs, payload
//   std::fwrite(record.data(), 1, record.size(), file);
//   std::uint32_t check = d9d::track::crc32c("123456789");     // 0xE3069283
//
// A record is: the payload length as uint64 little-endian, the masked CRC32C of those 8 bytes
// (uint32 little-endian), the payload, the masked CRC32C of the payload. CRC32C is the CRC-32 with
// the Castagnoli polynomial (reflected 0x82F63B78, init and final xor 0xFFFFFFFF); the mask is
// ((crc >> 15) | (crc << 17)) + 0xa282ead8. Pure functions: no I/O, no state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace d9d::track {

/// CRC32C (Castagnoli) of `data`.
[[nodiscard]] std::uint32_t crc32c(std::string_view data);

/// The masked CRC32C that TFRecord stores: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
[[nodiscard]] std::uint32_t masked_crc32c(std::string_view data);

/// One complete record around `payload` (payload.size() + 16 bytes).
[[nodiscard]] std::string tfrecord_frame(std::string_view payload);

}  // namespace d9d::track
