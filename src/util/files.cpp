// d9d/util/files.cpp — POSIX implementations of d9d::files.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <d9d/util/files.hpp>

namespace d9d::files {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("d9d: cannot " + what + " \"" + path + "\": " + std::strerror(errno));
}

[[noreturn]] void fail_creating(std::string_view who, const std::string& path,
                                const std::string& reason) {
  throw std::runtime_error(std::string(who) + ": cannot create directory '" + path +
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

int remove_entry(const char* path, const struct stat* /*info*/, int /*flag*/, struct FTW* /*ftw*/) {
  return ::remove(path);
}

}  // namespace

void create_directories(const std::string& path, std::string_view who) {
  if (path.empty() || directory_status(path) == 0) {
    return;
  }
  // mkdir each prefix ending before a '/' (then `path` itself). A prefix that exists is fine
  // (EEXIST); if it is a file, the next mkdir fails with ENOTDIR.
  for (std::size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    if (!prefix.empty() && prefix.back() != '/' && ::mkdir(prefix.c_str(), 0777) != 0) {
      const int error = errno;
      if (error != EEXIST && directory_status(prefix) != 0) {
        fail_creating(who, path, std::strerror(error));
      }
    }
    if (end == std::string::npos) {
      break;
    }
  }
  const int status = directory_status(path);
  if (status == ENOTDIR) {
    fail_creating(who, path, "it exists and is not a directory");
  }
  if (status != 0) {
    fail_creating(who, path, std::strerror(status));
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

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) {
    if (errno == ENOENT) {
      return names;
    }
    fail("list", dir);
  }
  while (const dirent* entry = ::readdir(handle)) {  // NOLINT(concurrency-mt-unsafe): own handle
    const std::string name = entry->d_name;
    if (name != "." && name != "..") {
      names.push_back(name);
    }
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

std::string hostname() {
  std::array<char, 256> buffer{};
  if (::gethostname(buffer.data(), buffer.size() - 1) != 0 || buffer[0] == '\0') {
    return "localhost";
  }
  return {buffer.data()};
}

// ---- AtomicFile ---------------------------------------------------------------------------------

AtomicFile::AtomicFile(std::string path, std::string who)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), who_(std::move(who)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    fail("cannot create");
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::fail(const std::string& what) const {
  const int error = errno;
  throw std::runtime_error(who_ + ": " + tmp_ + ": " + what + " (" + std::strerror(error) + ")");
}

void AtomicFile::write(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most 0x7ffff000 bytes per call.
    const ssize_t written = ::write(fd_, bytes, std::min<std::size_t>(size, std::size_t{1} << 30));
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      fail("write failed");
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) {
    fail("fsync failed");
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    errno = error;
    fail("close failed");
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    errno = error;
    fail("rename to " + path_ + " failed");
  }
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)::fsync(fd);
    ::close(fd);
  }
}

}  // namespace d9d::files
