// d9d/train/main.hpp — a program's main that reports any error once and exits non-zero, never
// aborting.
//
//   int main(int argc, char** argv) {
//     return d9d::run_main(argc, argv, [](int argc, char** argv) { ... return 0; });
//   }
//
// Without it, an exception escaping main (a d9d::ConfigError with its "did you mean" hint, a mesh
// that does not fit the world, a LibTorch error) ends in std::terminate: "terminate called after
// throwing an instance of ..." and SIGABRT (status 134) on every rank. run_main catches it, prints
// one line on this rank's standard error,
//
//   [d9d rank 1/2] error: d9d config: unknown key "run.total_step" (did you mean
//   "run.total_steps"?); ...
//
// and returns the exit status: 2 for a configuration error (d9d::ConfigError), 1 for any other.
// Every rank that fails reports its own error once; d9drun, torchrun and Slurm then see a non-zero
// status from each. The body may take (int, char**) or nothing and return int or void (0).
#pragma once

#include <exception>
#include <type_traits>
#include <utility>

namespace d9d {

/// Exit status of run_main for a d9d::ConfigError (a usage error, as in sysexits' spirit).
inline constexpr int kConfigErrorStatus = 2;
/// Exit status of run_main for any other error.
inline constexpr int kErrorStatus = 1;

/// Prints `error` as one "[d9d rank r/w] error: ..." line on standard error (the rank from the
/// launcher's environment; LibTorch errors without their C++ backtrace) and returns the exit
/// status for it. Never throws.
int report_error(const std::exception_ptr& error) noexcept;

/// Runs `body` (invocable with (argc, argv) or with nothing, returning int or void) and turns any
/// exception it throws into report_error's line and status.
template <class Body>
int run_main(int argc, char** argv, Body&& body) noexcept {
  try {
    if constexpr (std::is_invocable_v<Body&&, int, char**>) {
      if constexpr (std::is_void_v<std::invoke_result_t<Body&&, int, char**>>) {
        std::forward<Body>(body)(argc, argv);
        return 0;
      } else {
        return static_cast<int>(std::forward<Body>(body)(argc, argv));
      }
    } else {
      static_assert(std::is_invocable_v<Body&&>,
                    "d9d::run_main: the body must be invocable as body(argc, argv) or body(). Fix: "
                    "pass [](int argc, char** argv) { ...; return 0; }");
      if constexpr (std::is_void_v<std::invoke_result_t<Body&&>>) {
        std::forward<Body>(body)();
        return 0;
      } else {
        return static_cast<int>(std::forward<Body>(body)());
      }
    }
  } catch (...) {
    return report_error(std::current_exception());
  }
}

}  // namespace d9d
