// d9d/util/files.hpp — the few file-system operations the library needs, on POSIX calls.
//
//   d9d::files::create_directories(run_dir + "/tensorboard");   // mkdir -p; throws with the reason
//   d9d::files::rename(tmp, final_path);
//   if (d9d::files::exists(path)) { ... }
//   d9d::files::AtomicFile out(path, who);  out.write(bytes, n);  out.commit();  // tmp + rename
//
// Not std::filesystem: libtorch_cpu.so and libtorch.so export their own copies of
// std::filesystem's functions, and calls from code built by another compiler can bind to them
// (a crash seen on the GPU machine). These wrappers avoid the ambiguity.
#pragma once

#include <cstddef>
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

/// A file written as `<path>.tmp` and renamed over `path` by commit() after fsync, so readers see
/// the old file or the whole new one. Destroyed without commit(): the temporary is removed.
/// Errors: std::runtime_error "<who>: <path>.tmp: <what> (<strerror>)".
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string who);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile(AtomicFile&&) = delete;
  AtomicFile& operator=(AtomicFile&&) = delete;
  ~AtomicFile();

  void write(const void* data, std::size_t size);
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  std::string tmp_;
  std::string who_;
  int fd_ = -1;
};

/// fsyncs the directory `dir`, so renames inside it survive a crash; errors are ignored (some file
/// systems refuse fsync on directories).
void sync_directory(const std::string& dir);

}  // namespace d9d::files
