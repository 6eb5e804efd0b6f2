// Replays the committed seed corpus (tests/state/fuzz/corpus) through the fuzz target, so CI runs
// it with gcc on every change; tools/fuzz/safetensors runs the same target under libFuzzer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <dirent.h>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <d9d/state/safetensors.hpp>

#include "tests/state/state_test_support.hpp"

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer calls
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size);

namespace {

std::vector<std::string> corpus_files() {
  const char* dir = std::getenv("D9D_SAFETENSORS_CORPUS");
  EXPECT_NE(dir, nullptr) << "D9D_SAFETENSORS_CORPUS is not set; run this test through Bazel";
  std::vector<std::string> files;
  if (dir == nullptr) {
    return files;
  }
  DIR* listing = ::opendir(dir);
  EXPECT_NE(listing, nullptr) << dir;
  if (listing == nullptr) {
    return files;
  }
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name.starts_with("valid_") || name.starts_with("bad_")) {
      files.push_back(std::string(dir) + "/" + name);
    }
  }
  ::closedir(listing);
  return files;
}

TEST(State_SafetensorsFuzz_Corpus, EverySeedPassesTheTargetAndIsClassifiedRight) {
  const auto files = corpus_files();
  EXPECT_GE(files.size(), 30U);
  for (const auto& path : files) {
    SCOPED_TRACE(path);
    const std::string bytes = d9d::testing::state::read_file(path);
    EXPECT_EQ(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
              0);
    bool accepted = true;
    try {
      (void)d9d::state::SafetensorsFile(path).tensors();
    } catch (const std::runtime_error&) {
      accepted = false;
    }
    const bool valid = path.substr(path.rfind('/') + 1).starts_with("valid_");
    EXPECT_EQ(accepted, valid) << (valid ? "a valid seed was refused" : "a bad seed was accepted");
  }
}

}  // namespace
