// d9d/state/safetensors.cpp — the safetensors writer and its checking reader.
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <set>
#include <stdexcept>
#include <string_view>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <ATen/ops/empty.h>
#include <nlohmann/json.hpp>

#include <d9d/state/safetensors.hpp>

namespace d9d::state {

static_assert(std::endian::native == std::endian::little,
              "d9d::state safetensors I/O copies tensor bytes as they are in memory; the format is "
              "little-endian, so a big-endian host needs a byte swap here");

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeName {
  at::ScalarType dtype;
  std::string_view name;
};
constexpr std::array<DtypeName, 10> kDtypes = {{
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
}};

std::string supported_names() {
  std::string names;
  for (const auto& entry : kDtypes) {
    names += (names.empty() ? "" : " ") + std::string(entry.name);
  }
  return names;
}

// The format's name of `dtype`; empty when it has none here.
std::string_view name_of(at::ScalarType dtype) {
  for (const auto& entry : kDtypes) {
    if (entry.dtype == dtype) {
      return entry.name;
    }
  }
  return {};
}

std::string no_name(at::ScalarType dtype) {
  return "dtype " + std::string(c10::toString(dtype)) +
         " has no safetensors name here (supported: " + supported_names() + ")";
}

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd(const Fd&) = delete;
  Fd& operator=(Fd&&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { close(); }
  [[nodiscard]] int get() const { return fd_; }
  int close() {
    const int rc = fd_ >= 0 ? ::close(fd_) : 0;
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// ---- writing ------------------------------------------------------------------------------------

[[noreturn]] void write_failed(const std::string& path, const std::string& what) {
  const int error = errno;
  throw std::runtime_error("d9d::state::save_safetensors: " + path + ": " + what + " (" +
                           std::strerror(error) + ")");
}

void write_all(int fd, const void* data, std::size_t size, const std::string& path) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      write_failed(path, "write failed");
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

// ---- reading ------------------------------------------------------------------------------------

// One tensor's entry of the header, checked.
struct Entry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The checked header of an open file.
struct Header {
  std::vector<Entry> entries;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
};

class Reader {
 public:
  Reader(std::string path, std::string who) : path_(std::move(path)), who_(std::move(who)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(who_ + ": " + path_ + ": " + what);
  }
  [[noreturn]] void fail(const std::string& tensor, const std::string& what) const {
    fail("tensor \"" + tensor + "\": " + what);
  }

  [[nodiscard]] const std::string& path() const { return path_; }

  // Reads `size` bytes at `offset`, all of them or an error.
  void read_at(int fd, void* data, std::size_t size, uint64_t offset) const {
    auto* bytes = static_cast<char*>(data);
    while (size > 0) {
      const ssize_t got = ::pread(fd, bytes, size, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) {
        continue;
      }
      if (got <= 0) {
        fail(got == 0 ? std::string("unexpected end of file")
                      : "read failed (" + std::string(std::strerror(errno)) + ")");
      }
      bytes += got;
      offset += static_cast<uint64_t>(got);
      size -= static_cast<std::size_t>(got);
    }
  }

  [[nodiscard]] Header read_header(int fd) const {
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      fail("not a regular file");
    }
    const auto file_size = static_cast<uint64_t>(info.st_size);
    if (file_size < 8) {
      fail("only " + std::to_string(file_size) +
           " bytes, shorter than the 8-byte header length; not a safetensors file");
    }
    std::array<unsigned char, 8> length_bytes{};
    read_at(fd, length_bytes.data(), length_bytes.size(), 0);
    uint64_t length = 0;
    for (std::size_t i = 0; i < length_bytes.size(); ++i) {
      length |= static_cast<uint64_t>(length_bytes[i]) << (8U * i);
    }
    if (length > file_size - 8) {
      fail("header length " + std::to_string(length) + " runs past the end of the file (" +
           std::to_string(file_size) + " bytes); truncated or not a safetensors file");
    }
    std::string text(static_cast<std::size_t>(length), '\0');
    read_at(fd, text.data(), text.size(), 8);

    Header header;
    header.data_start = 8 + length;
    const Json json = parse(text);
    const uint64_t data_size = file_size - header.data_start;
    for (const auto& [name, value] : json.items()) {
      if (name == kMetadataKey) {
        header.metadata = parse_metadata(value);
      } else {
        header.entries.push_back(parse_entry(name, value, data_size));
      }
    }
    check_layout(header.entries, data_size);
    return header;
  }

 private:
  [[nodiscard]] Json parse(const std::string& text) const {
    // The callback sees every key; a name given twice would otherwise silently keep the last.
    std::set<std::string> names;
    std::string duplicate;
    const Json::parser_callback_t on_event = [&](int depth, Json::parse_event_t event,
                                                 Json& parsed) {
      if (event == Json::parse_event_t::key && depth == 1 && duplicate.empty() &&
          !names.insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    Json json;
    try {
      json = Json::parse(text, on_event);
    } catch (const Json::exception& error) {
      fail("bad JSON header (" + std::string(error.what()) + ")");
    }
    if (!duplicate.empty()) {
      fail(duplicate, "appears twice in the header");
    }
    if (!json.is_object()) {
      fail("the JSON header is not an object");
    }
    return json;
  }

  [[nodiscard]] std::map<std::string, std::string> parse_metadata(const Json& value) const {
    if (!value.is_object()) {
      fail("\"__metadata__\" is not an object");
    }
    std::map<std::string, std::string> metadata;
    for (const auto& [key, item] : value.items()) {
      if (!item.is_string()) {
        fail("\"__metadata__\" value of \"" + key + "\" is not a string");
      }
      metadata.emplace(key, item.get<std::string>());
    }
    return metadata;
  }

  [[nodiscard]] Entry parse_entry(const std::string& name, const Json& value,
                                  uint64_t data_size) const {
    if (!value.is_object()) {
      fail(name, "its header entry is not an object");
    }
    for (const char* key : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(key)) {
        fail(name, std::string("its header entry has no \"") + key + "\"");
      }
    }
    Entry entry;
    entry.name = name;
    const Json& dtype = value.at("dtype");
    const auto known = std::find_if(kDtypes.begin(), kDtypes.end(), [&](const DtypeName& d) {
      return dtype.is_string() && d.name == dtype.get<std::string>();
    });
    if (known == kDtypes.end()) {
      fail(name, "unknown dtype " + dtype.dump() + " (supported: " + supported_names() + ")");
    }
    entry.dtype = known->dtype;

    const Json& shape = value.at("shape");
    if (!shape.is_array()) {
      fail(name, "\"shape\" is not an array");
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (const Json& dim : shape) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0) {
        fail(name, "\"shape\" " + shape.dump() + " has an entry that is not an integer >= 0");
      }
      entry.shape.push_back(dim.get<int64_t>());
      overflow = overflow || __builtin_mul_overflow(numel, dim.get<uint64_t>(), &numel);
    }
    uint64_t bytes = 0;
    overflow = overflow || __builtin_mul_overflow(
                               numel, static_cast<uint64_t>(c10::elementSize(entry.dtype)), &bytes);

    const Json& offsets = value.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      fail(name, "\"data_offsets\" " + offsets.dump() + " is not [begin, end] of integers >= 0");
    }
    entry.begin = offsets[0].get<uint64_t>();
    entry.end = offsets[1].get<uint64_t>();
    if (entry.begin > entry.end || entry.end > data_size) {
      fail(name, "\"data_offsets\" " + offsets.dump() + " are out of range: the data has " +
                     std::to_string(data_size) + " bytes");
    }
    if (overflow || bytes != entry.end - entry.begin) {
      fail(name, "shape " + shape.dump() + " of " + std::string(known->name) + " needs " +
                     (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                     " bytes, but \"data_offsets\" " + offsets.dump() + " hold " +
                     std::to_string(entry.end - entry.begin));
    }
    return entry;
  }

  // Orders the entries by offset and checks that they tile the data exactly, as the format asks.
  void check_layout(std::vector<Entry>& entries, uint64_t data_size) const {
    std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t covered = 0;
    const Entry* previous = nullptr;
    for (const auto& entry : entries) {
      if (entry.begin < covered) {
        fail(entry.name, "its bytes [" + std::to_string(entry.begin) + ", " +
                             std::to_string(entry.end) + ") overlap tensor \"" + previous->name +
                             "\" (ends at " + std::to_string(covered) + ")");
      }
      if (entry.begin > covered) {
        fail(entry.name, "the data bytes [" + std::to_string(covered) + ", " +
                             std::to_string(entry.begin) +
                             ") before it belong to no tensor (the format allows no holes)");
      }
      covered = entry.end;
      previous = &entry;
    }
    if (covered != data_size) {
      fail("the data has " + std::to_string(data_size) + " bytes but the tensors cover only " +
           std::to_string(covered) + " (the format allows no trailing bytes)");
    }
  }

  std::string path_;
  std::string who_;
};

Fd open_for_reading(const Reader& reader) {
  Fd fd(::open(reader.path().c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    reader.fail("cannot open (" + std::string(std::strerror(errno)) + ")");
  }
  return fd;
}

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  const std::string_view name = name_of(dtype);
  if (name.empty()) {
    throw std::invalid_argument("d9d::state::safetensors_dtype_name: " + no_name(dtype));
  }
  return std::string(name);
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string who = "d9d::state::save_safetensors: " + path + ": ";
  Json header = Json::object();
  if (!metadata.empty()) {
    header[std::string(kMetadataKey)] = Json(metadata);
  }
  std::vector<at::Tensor> data;
  data.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == kMetadataKey) {
      throw std::invalid_argument(who + "\"__metadata__\" is reserved and cannot name a tensor");
    }
    if (header.contains(name)) {
      throw std::invalid_argument(who + "tensor name \"" + name + "\" is given twice");
    }
    if (!tensor.defined()) {
      throw std::invalid_argument(who + "tensor \"" + name + "\" is undefined");
    }
    const std::string_view dtype = name_of(tensor.scalar_type());
    if (dtype.empty()) {
      throw std::invalid_argument(who + "tensor \"" + name +
                                  "\": " + no_name(tensor.scalar_type()));
    }
    at::Tensor cpu = tensor.cpu().contiguous();
    const auto bytes = static_cast<uint64_t>(cpu.nbytes());
    header[name] = {{"dtype", std::string(dtype)},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(cpu));
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error& error) {
    throw std::invalid_argument(who + "a tensor name or metadata string is not valid UTF-8 (" +
                                error.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::array<unsigned char, 8> length{};
  for (std::size_t i = 0; i < length.size(); ++i) {
    length[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8U * i));
  }

  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    write_failed(tmp, "cannot create");
  }
  try {
    write_all(fd.get(), length.data(), length.size(), tmp);
    write_all(fd.get(), text.data(), text.size(), tmp);
    for (const auto& tensor : data) {
      if (tensor.nbytes() > 0) {
        write_all(fd.get(), tensor.const_data_ptr(), tensor.nbytes(), tmp);
      }
    }
    if (::fsync(fd.get()) != 0) {
      write_failed(tmp, "fsync failed");
    }
    if (fd.close() != 0) {
      write_failed(tmp, "close failed");
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      write_failed(tmp, "rename to " + path + " failed");
    }
  } catch (...) {
    fd.close();
    ::unlink(tmp.c_str());
    throw;
  }
}

NamedTensors load_safetensors(const std::string& path) {
  const Reader reader(path, "d9d::state::load_safetensors");
  const Fd fd = open_for_reading(reader);
  const Header header = reader.read_header(fd.get());
  NamedTensors tensors;
  tensors.reserve(header.entries.size());
  for (const auto& entry : header.entries) {
    at::Tensor tensor = at::empty(entry.shape, entry.dtype);
    const auto bytes = static_cast<std::size_t>(entry.end - entry.begin);
    if (bytes > 0) {
      reader.read_at(fd.get(), tensor.mutable_data_ptr(), bytes, header.data_start + entry.begin);
    }
    if (entry.dtype == at::kBool) {
      const auto* values = static_cast<const unsigned char*>(tensor.const_data_ptr());
      if (std::any_of(values, values + bytes, [](unsigned char v) { return v > 1; })) {
        reader.fail(entry.name, "a BOOL byte is neither 0 nor 1");
      }
    }
    tensors.emplace_back(entry.name, std::move(tensor));
  }
  return tensors;
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  const Reader reader(path, "d9d::state::read_safetensors_metadata");
  const Fd fd = open_for_reading(reader);
  return reader.read_header(fd.get()).metadata;
}

}  // namespace d9d::state
