// File plumbing shared by the track writers: every failure names the path and the reason.
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include <d9d/track/detail/file.hpp>

namespace d9d::track::detail {

namespace {

[[noreturn]] void fail(std::string_view who, std::string_view verb, const std::string& path,
                       const std::string& reason) {
  throw std::runtime_error(std::string(who) + ": cannot " + std::string(verb) + " '" + path +
                           "': " + reason + ". Fix: pass a path on a writable file system");
}

}  // namespace

void FileCloser::operator()(std::FILE* file) const noexcept {
  if (std::fclose(file) != 0) {
    const int error = errno;
    std::fprintf(stderr, "d9d::track: closing a file failed: %s\n", std::strerror(error));
  }
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
