// d9d/util/files.hpp — the few file-system operations the library needs, on POSIX calls.
//
//   d9d::files::create_directories(run_dir + "/tensorboard");   // mkdir -p; throws with the reason
//   d9d::files::rename(tmp, final_path);
//   if (d9d::files::exists(path)) { ... }
//
// Not std::filesystem: libtorch_cpu.so and libtorch.so export their own copies of
// std::filesystem's functions, and calls from code built by another compiler can bind to them
// (a crash seen on the GPU machine). These wrappers avoid the ambiguity.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace d9d::files {

/// Creates `path` and its missing parents (mode 0777 less the umask), like `mkdir -p`; an existing
/// directory is fine, "" does nothing. Failure: std::runtime_error
/// "<who>: cannot create directory '<path>': <reason>. Fix: pass a path on a writable file system".
void create_directories(const std::string& path, std::string_view who = "d9d");
/// True when `path` exists (file, directory or other).
[[nodiscard]] bool exists(const std::string& path);
/// True when `path` is a directory.
[[nodiscard]] bool is_directory(const std::string& path);
/// Removes `path` and everything under it (no error when it does not exist).
void remove_tree(const std::string& path);
/// Renames atomically within one file system; std::runtime_error naming both paths.
void rename(const std::string& from, const std::string& to);
/// `dir` + "/" + `name` (no doubled slash).
[[nodiscard]] std::string join(std::string_view dir, std::string_view name);
/// The directory part of `path`: "a/b" for "a/b/c", "/" for "/c", "" for a bare name.
[[nodiscard]] std::string parent(std::string_view path);
/// The names in directory `dir` (without "." and ".."), sorted; none when `dir` does not exist.
/// std::runtime_error naming `dir` when it cannot be read.
[[nodiscard]] std::vector<std::string> list_directory(const std::string& dir);
/// This machine's host name ("localhost" when it cannot be read).
[[nodiscard]] std::string hostname();

}  // namespace d9d::files
