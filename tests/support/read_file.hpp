// Test helper: a whole file's bytes, for tests that check what the library wrote.
//
//   EXPECT_THAT(d9d::testing::read_file(dir + "/metrics.jsonl"), HasSubstr("\"train/loss\""));
#pragma once

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace d9d::testing {

/// The bytes of `path`; std::runtime_error naming it when it cannot be opened (a missing file
/// fails the test instead of reading as empty).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("read_file: cannot open " + path);
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace d9d::testing
