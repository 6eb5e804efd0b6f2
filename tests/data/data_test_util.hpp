// Helpers of the data tests: scratch files and raw token files.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/read_file.hpp"

namespace data_test {

/// A fresh directory under $TEST_TMPDIR (Bazel) or /tmp.
inline std::string scratch_dir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/d9d_data_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed under " + pattern);
  }
  return pattern;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    throw std::runtime_error("cannot write " + path);
  }
}

using d9d::testing::read_file;

/// `ids` as the raw token format: little-endian, `width` bytes each.
inline std::string raw_tokens(const std::vector<uint32_t>& ids, int width) {
  std::string bytes;
  for (const uint32_t id : ids) {
    for (int b = 0; b < width; ++b) {
      bytes.push_back(static_cast<char>((id >> (8U * static_cast<unsigned>(b))) & 0xFFU));
    }
  }
  return bytes;
}

/// first, first + 1, ..., first + count - 1.
inline std::vector<uint32_t> iota_ids(uint32_t first, uint32_t count) {
  std::vector<uint32_t> ids(count);
  for (uint32_t i = 0; i < count; ++i) {
    ids[i] = first + i;
  }
  return ids;
}

}  // namespace data_test
