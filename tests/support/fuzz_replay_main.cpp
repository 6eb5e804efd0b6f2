// Replays committed fuzz corpora through the fuzz target linked with this file, without libFuzzer
// (so CI runs it with gcc as a normal test; tools/fuzz/* runs the same target under libFuzzer):
//
//   config_fuzz_replay_test tests/train/fuzz/corpus [more dirs...]
//
// Every file is fed to LLVMFuzzerTestOneInput (the target aborts on a bug); a file named valid_*
// must be accepted and one named bad_* refused (d9d::testing::fuzz_input_accepted). Fails when a
// directory holds no file.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/support/fuzz_target.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>...\n", argv[0]);
    return 2;
  }
  int wrong = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path dir(
        argv[i]);  // NOLINT(cppcoreguidelines-pro-bounds-pointer-arithmetic)
    std::vector<std::filesystem::path> files;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
      if (entry.is_regular_file()) {
        files.push_back(entry.path());
      }
    }
    std::sort(files.begin(), files.end());
    if (error || files.empty()) {
      std::fprintf(stderr, "FAIL: no corpus files in %s\n", dir.c_str());
      return 1;
    }
    int valid = 0;
    int bad = 0;
    for (const auto& path : files) {
      std::ifstream in(path, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      (void)LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      const std::string name = path.filename().string();
      const bool accepted = d9d::testing::fuzz_input_accepted(bytes);
      if (name.starts_with("valid_")) {
        ++valid;
        if (!accepted) {
          std::fprintf(stderr, "FAIL: %s: a valid seed was refused\n", path.c_str());
          ++wrong;
        }
      } else if (name.starts_with("bad_")) {
        ++bad;
        if (accepted) {
          std::fprintf(stderr, "FAIL: %s: a bad seed was accepted\n", path.c_str());
          ++wrong;
        }
      }
    }
    std::printf("%s: %zu files replayed (%d valid_, %d bad_)\n", dir.c_str(), files.size(), valid,
                bad);
  }
  if (wrong != 0) {
    std::fprintf(stderr, "%d seed(s) classified wrongly\n", wrong);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
