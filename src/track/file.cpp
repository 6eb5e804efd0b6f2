// File plumbing shared by the track writers: every failure names the path and the reason.
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/stat.h>

#include <d9d/track/detail/file.hpp>

namespace d9d::track::detail {

namespace {

[[noreturn]] void fail(std::string_view who, std::string_view verb, const std::string& path,
                       const std::string& reason) {
  throw std::runtime_error(std::string(who) + ": cannot " + std::string(verb) + " '" + path +
                           "': " + reason + ". Fix: pass a path on a writable file system");
}

/// 0 when `path` is a directory, else the errno of stat (or ENOTDIR when it is something else).
int directory_status(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    return errno;
  }
  return S_ISDIR(info.st_mode) ? 0 : ENOTDIR;
}

}  // namespace

void FileCloser::operator()(std::FILE* file) const noexcept {
  if (std::fclose(file) != 0) {
    const int error = errno;
    std::fprintf(stderr, "d9d::track: closing a file failed: %s\n", std::strerror(error));
  }
}

void create_directories(const std::string& dir, std::string_view who) {
  if (dir.empty() || directory_status(dir) == 0) {
    return;
  }
  // mkdir each prefix ending before a '/' (then `dir` itself), like `mkdir -p`. A prefix that
  // exists is fine (EEXIST); if it is a file, the next mkdir fails with ENOTDIR.
  for (std::size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string prefix = dir.substr(0, end);
    if (!prefix.empty() && prefix.back() != '/' && ::mkdir(prefix.c_str(), 0777) != 0) {
      const int error = errno;
      if (error != EEXIST && directory_status(prefix) != 0) {
        fail(who, "create directory", dir, std::strerror(error));
      }
    }
    if (end == std::string::npos) {
      break;
    }
  }
  const int status = directory_status(dir);
  if (status == ENOTDIR) {
    fail(who, "create directory", dir, "it exists and is not a directory");
  }
  if (status != 0) {
    fail(who, "create directory", dir, std::strerror(status));
  }
}

std::string join(std::string_view dir, std::string_view name) {
  if (dir.empty()) {
    return std::string(name);
  }
  std::string out(dir);
  if (out.back() != '/') {
    out += '/';
  }
  out += name;
  return out;
}

std::string parent(std::string_view path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) {
    return "";
  }
  std::string_view dir = path.substr(0, slash);
  while (!dir.empty() && dir.back() == '/') {
    dir.remove_suffix(1);
  }
  return dir.empty() ? std::string("/") : std::string(dir);
}

FilePtr open_file(const std::string& path, const char* mode, std::string_view who) {
  FilePtr file(std::fopen(path.c_str(), mode));
  if (!file) {
    const int error = errno;
    fail(who, "open", path, std::strerror(error));
  }
  return file;
}

FilePtr create_new_file(const std::string& path, std::string_view who) {
  FilePtr file(std::fopen(path.c_str(), "wbx"));
  if (!file) {
    const int error = errno;
    if (error == EEXIST) {
      return nullptr;
    }
    fail(who, "create", path, std::strerror(error));
  }
  return file;
}

void write_all(std::FILE* file, std::string_view data, const std::string& path,
               std::string_view who) {
  if (std::fwrite(data.data(), 1, data.size(), file) != data.size()) {
    const int error = errno;
    fail(who, "write", path, std::strerror(error));
  }
}

void flush(std::FILE* file, const std::string& path, std::string_view who) {
  if (std::fflush(file) != 0) {
    const int error = errno;
    fail(who, "write", path, std::strerror(error));
  }
}

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace d9d::track::detail
