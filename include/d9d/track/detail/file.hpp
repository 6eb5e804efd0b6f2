// d9d/track/detail/file.hpp — file plumbing shared by the track writers (not public API).
//
//   detail::FilePtr file = detail::open_file(path, "ab", who);     // closed on destruction
//   detail::write_all(file.get(), line, path, who);                // throws on a short write
//
// Every failure is a std::runtime_error "<who>: cannot <verb> '<path>': <strerror>. Fix: ...".
// Paths are std::string and the work is done with POSIX calls, not the C++17 file-system library:
// libtorch_cpu.so and libtorch.so export their own copies of its functions, and calls from code
// built by another compiler can bind to them (a crash seen on the GPU machine). Directories and
// paths come from d9d::files (d9d/util/files.hpp).
#pragma once

#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace d9d::track::detail {

/// Closes a FILE* (errors on close are reported on stderr: a destructor must not throw).
struct FileCloser {
  void operator()(std::FILE* file) const noexcept;
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

/// std::fopen(path, mode); throws when it fails.
[[nodiscard]] FilePtr open_file(const std::string& path, const char* mode, std::string_view who);

/// Creates `path`, which must not exist yet (fopen "wbx"); nullptr when it already exists, throws
/// on any other failure.
[[nodiscard]] FilePtr create_new_file(const std::string& path, std::string_view who);

/// Writes all of `data` to `file`; throws on a short write.
void write_all(std::FILE* file, std::string_view data, const std::string& path,
               std::string_view who);

/// std::fflush(file); throws when it fails (e.g. the disk is full).
void flush(std::FILE* file, const std::string& path, std::string_view who);

/// Seconds since the Unix epoch, from the system clock.
[[nodiscard]] double unix_time_now();

}  // namespace d9d::track::detail
