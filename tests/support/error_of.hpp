// Test helper: the message of the exception a callable throws, to check diagnostics with matchers.
//
//   EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] { parse(bad); }),
//               HasSubstr("\"batch.microbatch_size\""));
#pragma once

#include <exception>
#include <string>

namespace d9d::testing {

/// e.what() of the `Error` that `f()` throws; "no error" when it returns normally (any other
/// exception propagates, failing the test).
template <class Error = std::exception, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace d9d::testing
