// d9d/train/main.cpp — run_main's error report (d9d/train/main.hpp).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

#include <d9d/core/distributed_context.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/main.hpp>

namespace d9d {

namespace {

// "[d9d rank r/w]" from the launcher's environment, as the context's logger writes it.
std::string rank_prefix() noexcept {
  try {
    const LaunchInfo launch =
        parse_launch_env([](std::string_view name) -> std::optional<std::string> {
          const char* value =
              std::getenv(std::string(name).c_str());  // NOLINT(concurrency-mt-unsafe)
          return value != nullptr ? std::optional<std::string>(value) : std::nullopt;
        });
    return "[d9d rank " + std::to_string(launch.rank) + "/" + std::to_string(launch.world_size) +
           "]";
  } catch (...) {
    return "[d9d]";
  }
}

}  // namespace

int report_error(const std::exception_ptr& error) noexcept {
  std::string message;
  int status = kErrorStatus;
  try {
    std::rethrow_exception(error);
  } catch (const ConfigError& e) {
    message = e.what();
    status = kConfigErrorStatus;
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();  // LibTorch's C++ backtrace is not the user's problem
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  try {
    const std::string line = rank_prefix() + " error: " + message + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);  // one write: ranks do not interleave
    std::fflush(stderr);
  } catch (...) {
    std::fputs("[d9d] error (the message could not be formatted)\n", stderr);
  }
  return status;
}

}  // namespace d9d
