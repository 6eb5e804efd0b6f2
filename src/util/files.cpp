// d9d/util/files.cpp — POSIX implementations of d9d::files.
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ftw.h>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>

#include <d9d/util/files.hpp>

namespace d9d::files {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("d9d: cannot " + what + " \"" + path + "\": " + std::strerror(errno));
}

int remove_entry(const char* path, const struct stat* /*info*/, int /*flag*/, struct FTW* /*ftw*/) {
  return ::remove(path);
}

}  // namespace

void create_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) {
    return;
  }
  const auto up = parent(path);
  if (up != path && up != "." && up != "/") {
    create_directories(up);
  }
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    fail("create directory", path);
  }
  if (!is_directory(path)) {
    errno = ENOTDIR;
    fail("create directory", path);
  }
}

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

void remove_tree(const std::string& path) {
  if (exists(path)) {
    ::nftw(path.c_str(), remove_entry, 16,
           FTW_DEPTH | FTW_PHYS);  // NOLINT(bugprone-unused-return-value)
  }
}

void rename(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    fail("rename \"" + from + "\" to", to);
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
  while (path.size() > 1 && path.back() == '/') {
    path.remove_suffix(1);
  }
  const auto slash = path.rfind('/');
  if (slash == std::string_view::npos) {
    return ".";
  }
  return slash == 0 ? "/" : std::string(path.substr(0, slash));
}

std::string hostname() {
  std::array<char, 256> buffer{};
  if (::gethostname(buffer.data(), buffer.size() - 1) != 0 || buffer[0] == '\0') {
    return "localhost";
  }
  return {buffer.data()};
}

}  // namespace d9d::files
