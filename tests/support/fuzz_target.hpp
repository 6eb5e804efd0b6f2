// What each fuzz target of the project defines (tests/*/fuzz/*_fuzz.cpp), for libFuzzer
// (tools/fuzz/*) and for the replay of its committed corpus (fuzz_replay_main.cpp, a normal test).
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size);  // aborts on a
//   bug bool d9d::testing::fuzz_input_accepted(std::string_view input);  // the reader took the
//   input
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer calls
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size);

namespace d9d::testing {

/// Whether the entry point under test accepts `input` (false: it refused it with its documented
/// error). The replay checks seeds named valid_* are accepted and bad_* refused.
bool fuzz_input_accepted(std::string_view input);

}  // namespace d9d::testing
