// d9d/state/safetensors.cpp — the safetensors writer and its checking, mapping reader.
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/json.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::state {

static_assert(std::endian::native == std::endian::little,
              "d9d::state safetensors I/O copies tensor bytes as they are in memory; the format is "
              "little-endian, so a big-endian host needs a byte swap here");

using util::Json;

namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeName {
  at::ScalarType dtype;
  std::string_view name;
};
constexpr std::array<DtypeName, 17> kDtypes = {{
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
    {at::kFloat8_e4m3fn, "F8_E4M3"},
    {at::kFloat8_e5m2, "F8_E5M2"},
    {at::kFloat8_e8m0fnu, "F8_E8M0"},
    {at::kUInt16, "U16"},
    {at::kUInt32, "U32"},
    {at::kUInt64, "U64"},
    {at::kComplexFloat, "C64"},
}};
// Dtypes of the format that pack several elements in a byte; LibTorch has no such element type.
constexpr std::array<std::string_view, 3> kSubByteDtypes = {"F4", "F6_E2M3", "F6_E3M2"};

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

// A read-only view of a file, mapped private and copy-on-write (so zero-copy tensors over it may
// be written to without touching the file). Unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&&) = delete;
  Mapping& operator=(Mapping&&) = delete;
  ~Mapping() {
    if (data_ != nullptr) {
      ::munmap(data_, size_);
    }
  }

  // Maps `path`; returns the reason on failure (the object stays empty).
  std::optional<std::string> map(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return "cannot open (" + std::string(std::strerror(errno)) + ")";
    }
    std::optional<std::string> problem;
    struct stat info {};
    if (::fstat(fd, &info) != 0) {
      problem = "cannot stat (" + std::string(std::strerror(errno)) + ")";
    } else if (!S_ISREG(info.st_mode)) {
      problem = "not a regular file";
    } else if (info.st_size < 8) {
      problem = "only " + std::to_string(info.st_size) +
                " bytes, shorter than the 8-byte header length; not a safetensors file";
    } else {
      size_ = static_cast<std::size_t>(info.st_size);
      void* data = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        problem = "cannot map (" + std::string(std::strerror(errno)) + ")";
        size_ = 0;
      } else {
        data_ = data;
      }
    }
    ::close(fd);  // the mapping keeps the file
    return problem;
  }

  [[nodiscard]] unsigned char* data() const { return static_cast<unsigned char*>(data_); }
  [[nodiscard]] std::size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace

namespace detail {

// Everything an open file holds; shared by copies of SafetensorsFile and by zero-copy views.
struct SafetensorsState {
  std::string path;
  std::string who;
  Mapping mapping;
  std::string owned;  // the image of from_bytes
  unsigned char* bytes = nullptr;
  uint64_t size = 0;
  uint64_t data_offset = 0;
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::size_t, std::less<>> index;
  std::map<std::string, std::string> metadata;
  // Pages of a tensor that has been viewed may hold private writes: never dropped by a copy.
  std::mutex mutex;
  std::vector<bool> viewed;
  // Views of each tensor still alive (release leaves such a tensor alone).
  std::vector<std::size_t> live_views;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(who + ": " + path + ": " + what);
  }
  [[noreturn]] void fail(std::string_view tensor, const std::string& what) const {
    fail("tensor " + util::quoted(tensor) + ": " + what);
  }
  [[nodiscard]] const SafetensorsEntry& find(std::string_view name) const;
  [[nodiscard]] at::Tensor copy(std::size_t i);
  void check_bool(const SafetensorsEntry& entry, const unsigned char* data) const;
  [[nodiscard]] at::Tensor empty(const SafetensorsEntry& entry) const;
  void parse_header();

 private:
  [[nodiscard]] std::map<std::string, std::string> parse_metadata(const Json& value) const;
  [[nodiscard]] SafetensorsEntry parse_entry(const std::string& name, const Json& value,
                                             uint64_t data_size) const;
  void check_layout(uint64_t data_size);
};

void SafetensorsState::parse_header() {
  uint64_t length = 0;
  for (std::size_t i = 0; i < 8; ++i) {
    length |= static_cast<uint64_t>(bytes[i]) << (8U * i);
  }
  if (length > size - 8) {
    fail("header length " + std::to_string(length) + " runs past the end of the file (" +
         std::to_string(size) + " bytes); truncated or not a safetensors file");
  }
  if (length > kSafetensorsMaxHeaderBytes) {
    fail("header length " + std::to_string(length) + " is over the limit of " +
         std::to_string(kSafetensorsMaxHeaderBytes) + " bytes; not a safetensors file");
  }
  data_offset = 8 + length;
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8),
                              static_cast<std::size_t>(length));
  Json json;
  try {
    // The deepest the format goes: {name: {"shape": [...]}}.
    json = util::parse_strict_json(text, 3);
  } catch (const util::JsonError& error) {
    const std::string where = error.top_key().empty() ? "header: "
                              : error.top_key() == kMetadataKey
                                  ? "\"__metadata__\": "
                                  : "tensor " + util::quoted(error.top_key()) + ": ";
    fail(where + error.what());
  }
  if (!json.is_object()) {
    fail("the JSON header is not an object");
  }
  const uint64_t data_size = size - data_offset;
  for (const auto& [name, value] : json.items()) {
    if (name == kMetadataKey) {
      metadata = parse_metadata(value);
    } else {
      entries.push_back(parse_entry(name, value, data_size));
    }
  }
  check_layout(data_size);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    index.emplace(entries[i].name, i);
  }
  viewed.assign(entries.size(), false);
  live_views.assign(entries.size(), 0);
}

std::map<std::string, std::string> SafetensorsState::parse_metadata(const Json& value) const {
  if (!value.is_object()) {
    fail("\"__metadata__\" is not an object");
  }
  std::map<std::string, std::string> result;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      fail("\"__metadata__\" value of " + util::quoted(key) + " is not a string but " +
           util::short_dump(item));
    }
    result.emplace(key, item.get<std::string>());
  }
  return result;
}

SafetensorsEntry SafetensorsState::parse_entry(const std::string& name, const Json& value,
                                               uint64_t data_size) const {
  if (!value.is_object()) {
    fail(name, "its header entry is not an object");
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) {
      fail(name, std::string("its header entry has no \"") + key + "\"");
    }
  }
  SafetensorsEntry entry;
  entry.name = name;
  const Json& dtype = value.at("dtype");
  const std::string dtype_name = dtype.is_string() ? dtype.get<std::string>() : "";
  const auto known = std::find_if(kDtypes.begin(), kDtypes.end(),
                                  [&](const DtypeName& d) { return d.name == dtype_name; });
  if (known == kDtypes.end()) {
    const bool sub_byte =
        std::find(kSubByteDtypes.begin(), kSubByteDtypes.end(), dtype_name) != kSubByteDtypes.end();
    fail(name, (sub_byte ? "dtype " + util::short_dump(dtype) +
                               " packs several elements per byte; LibTorch has no such type"
                         : "unknown dtype " + util::short_dump(dtype)) +
                   " (supported: " + supported_names() + ")");
  }
  entry.dtype = known->dtype;

  const Json& shape = value.at("shape");
  if (!shape.is_array()) {
    fail(name, "\"shape\" " + util::short_dump(shape) + " is not an array");
  }
  // Elements (0 when a dimension is 0) and the product of the non-zero dimensions, which bounds
  // every stride LibTorch computes: it must fit in int64.
  uint64_t extent = 1;
  bool zero = false;
  entry.shape.reserve(shape.size());
  for (const Json& dim : shape) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(name, "\"shape\" " + util::short_dump(shape) +
                     " has an entry that is not an integer in [0, 2^63)");
    }
    const auto size_of_dim = dim.get<uint64_t>();
    entry.shape.push_back(static_cast<int64_t>(size_of_dim));
    zero = zero || size_of_dim == 0;
    if (__builtin_mul_overflow(extent, std::max<uint64_t>(size_of_dim, 1), &extent) ||
        extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(name, "\"shape\" " + util::short_dump(shape) +
                     " is too large: the product of its dimensions passes 2^63");
    }
  }
  const uint64_t numel = zero ? 0 : extent;
  uint64_t bytes = 0;
  const bool overflow =
      __builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(entry.dtype)), &bytes);

  const Json& offsets = value.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(name,
         "\"data_offsets\" " + util::short_dump(offsets) + " is not [begin, end] of integers >= 0");
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end || entry.end > data_size) {
    fail(name, "\"data_offsets\" " + offsets.dump() + " are out of range: the data has " +
                   std::to_string(data_size) + " bytes");
  }
  if (overflow || bytes != entry.end - entry.begin) {
    fail(name, "shape " + util::short_dump(shape) + " of " + std::string(known->name) + " needs " +
                   (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                   " bytes, but \"data_offsets\" " + offsets.dump() + " hold " +
                   std::to_string(entry.end - entry.begin));
  }
  return entry;
}

// Orders the entries by offset and checks that they tile the data exactly, as the format asks.
void SafetensorsState::check_layout(uint64_t data_size) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& entry : entries) {
    if (entry.begin < covered) {
      fail(entry.name, "its bytes [" + std::to_string(entry.begin) + ", " +
                           std::to_string(entry.end) + ") overlap tensor " +
                           util::quoted(previous->name) + " (ends at " + std::to_string(covered) +
                           ")");
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

const SafetensorsEntry& SafetensorsState::find(std::string_view name) const {
  const auto found = index.find(name);
  if (found == index.end()) {
    std::string names;
    for (std::size_t i = 0; i < entries.size() && i < 8; ++i) {
      names += (i == 0 ? "" : ", ") + util::quoted(entries[i].name);
    }
    throw std::out_of_range(who + ": " + path + ": no tensor " + util::quoted(name) +
                            " (the file has " + std::to_string(entries.size()) +
                            (entries.empty() ? "" : ": ") + names +
                            (entries.size() > 8 ? ", ..." : "") + ")");
  }
  return entries[found->second];
}

void SafetensorsState::check_bool(const SafetensorsEntry& entry, const unsigned char* data) const {
  if (entry.dtype == at::kBool &&
      std::any_of(data, data + entry.nbytes(), [](unsigned char v) { return v > 1; })) {
    fail(entry.name, "a BOOL byte is neither 0 nor 1");
  }
}

at::Tensor SafetensorsState::empty(const SafetensorsEntry& entry) const {
  try {
    return at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
  } catch (const c10::Error& error) {  // out of memory, mostly
    fail(entry.name, std::string("cannot allocate it (") + error.what_without_backtrace() + ")");
  }
}

at::Tensor SafetensorsState::copy(std::size_t i) {
  const SafetensorsEntry& entry = entries[i];
  at::Tensor tensor = empty(entry);
  auto* out = static_cast<unsigned char*>(tensor.mutable_data_ptr());
  const unsigned char* in = bytes + data_offset + entry.begin;
  const std::size_t total = entry.nbytes();
  if (total == 0) {
    return tensor;  // no data: `out` may be null
  }
  if (mapping.data() == nullptr) {
    std::memcpy(out, in, total);  // an in-memory image
  } else {
    // Copy in chunks. Before each, when its source pages are all in the page cache, fault the
    // destination pages in with one call: a fault per page on first write is slower (by a third,
    // docs/state.md), but when the source must come from disk the faults overlap the reads and
    // faulting first only delays them. After each chunk, drop the source pages copied so far, so
    // a large file costs its copy in memory, not the copy plus the mapped file. Only pages wholly
    // inside this tensor are dropped, and only when it has never been viewed (a view may have
    // written to them). mincore and madvise are hints here: their errors are ignored.
    constexpr std::size_t kChunk = std::size_t{64} << 20;
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto page_up = [page](std::uintptr_t a) { return (a + page - 1) / page * page; };
    const auto page_down = [page](std::uintptr_t a) { return a / page * page; };
    const auto address = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
    // NOLINTNEXTLINE(performance-no-int-to-ptr): page addresses inside our own buffers
    const auto pointer = [](std::uintptr_t a) { return reinterpret_cast<void*>(a); };
#ifdef MADV_POPULATE_WRITE
    std::vector<unsigned char> resident;  // one byte per page, of mincore
#endif
    std::uintptr_t dropped = page_up(address(in));
    for (std::size_t done = 0; done < total;) {
      const std::size_t n = std::min(kChunk, total - done);
#ifdef MADV_POPULATE_WRITE
      const std::uintptr_t source = page_down(address(in + done));
      const std::size_t source_bytes = address(in + done + n) - source;
      resident.assign((source_bytes + page - 1) / page, 0);
      const bool cached = ::mincore(pointer(source), source_bytes, resident.data()) == 0 &&
                          std::all_of(resident.begin(), resident.end(),
                                      [](unsigned char r) { return (r & 1U) != 0; });
      const std::uintptr_t first = page_up(address(out + done));
      const std::uintptr_t last = page_down(address(out + done + n));
      if (cached && last > first) {
        (void)::madvise(pointer(first), last - first, MADV_POPULATE_WRITE);
      }
#endif
      std::memcpy(out + done, in + done, n);
      done += n;
      const std::uintptr_t upto = page_down(address(in + done));
      if (upto > dropped) {
        const std::lock_guard<std::mutex> lock(mutex);
        if (!viewed[i]) {
          (void)::madvise(pointer(dropped), upto - dropped, MADV_DONTNEED);
        }
        dropped = upto;
      }
    }
  }
  check_bool(entry, out);
  return tensor;
}

}  // namespace detail

// ---- SafetensorsFile ----------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(std::shared_ptr<detail::SafetensorsState> state)
    : state_(std::move(state)) {}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : SafetensorsFile(open_safetensors_as(path, "d9d::state::SafetensorsFile")) {}

SafetensorsFile open_safetensors_as(const std::string& path, std::string_view who) {
  auto state = std::make_shared<detail::SafetensorsState>();
  state->path = path;
  state->who = std::string(who);
  if (auto problem = state->mapping.map(path)) {
    state->fail(*problem);
  }
  state->bytes = state->mapping.data();
  state->size = state->mapping.size();
  state->parse_header();
  return SafetensorsFile(std::move(state));
}

SafetensorsFile SafetensorsFile::from_bytes(std::string bytes, std::string name) {
  auto state = std::make_shared<detail::SafetensorsState>();
  state->path = std::move(name);
  state->who = "d9d::state::SafetensorsFile";
  state->owned = std::move(bytes);
  state->bytes = reinterpret_cast<unsigned char*>(state->owned.data());
  state->size = state->owned.size();
  if (state->size < 8) {
    state->fail("only " + std::to_string(state->size) +
                " bytes, shorter than the 8-byte header length; not a safetensors file");
  }
  state->parse_header();
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::path() const { return state_->path; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return state_->metadata;
}
const std::vector<SafetensorsEntry>& SafetensorsFile::entries() const { return state_->entries; }
uint64_t SafetensorsFile::data_offset() const { return state_->data_offset; }
uint64_t SafetensorsFile::size() const { return state_->size; }

bool SafetensorsFile::contains(std::string_view name) const {
  return state_->index.find(name) != state_->index.end();
}

const SafetensorsEntry& SafetensorsFile::entry(std::string_view name) const {
  return state_->find(name);
}

at::Tensor SafetensorsFile::tensor(std::string_view name) const {
  const SafetensorsEntry& found = state_->find(name);
  return state_->copy(static_cast<std::size_t>(&found - state_->entries.data()));
}

at::Tensor SafetensorsFile::view(std::string_view name) const {
  const SafetensorsEntry& found = state_->find(name);
  const auto i = static_cast<std::size_t>(&found - state_->entries.data());
  unsigned char* data = state_->bytes + state_->data_offset + found.begin;
  const auto element = static_cast<std::uintptr_t>(c10::elementSize(found.dtype));
  if (found.nbytes() == 0 || reinterpret_cast<std::uintptr_t>(data) % element != 0) {
    return state_->copy(i);
  }
  state_->check_bool(found, data);
  {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    state_->viewed[i] = true;
    ++state_->live_views[i];
  }
  // The deleter owns a reference to the state, so the mapping lives as long as the tensor.
  return at::from_blob(
      data, found.shape,
      [keep = state_, i](void* /*data*/) mutable {
        {
          const std::lock_guard<std::mutex> lock(keep->mutex);
          --keep->live_views[i];
        }
        keep.reset();
      },
      at::TensorOptions().dtype(found.dtype));
}

bool SafetensorsFile::release(std::string_view name) const {
  const SafetensorsEntry& found = state_->find(name);
  const auto i = static_cast<std::size_t>(&found - state_->entries.data());
  if (state_->mapping.data() == nullptr) {
    return false;  // an in-memory image: nothing mapped
  }
  const std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->live_views[i] != 0) {
    return false;
  }
  // Only pages wholly inside this tensor: the neighbours' may be in use.
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin =
      reinterpret_cast<std::uintptr_t>(state_->bytes + state_->data_offset + found.begin);
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = (begin + found.nbytes()) / page * page;
  if (last > first) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): page addresses inside our own mapping
    (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
  state_->viewed[i] = false;  // private writes, if any, are gone with the pages
  return true;
}

NamedTensors SafetensorsFile::tensors() const {
  NamedTensors result;
  result.reserve(state_->entries.size());
  for (std::size_t i = 0; i < state_->entries.size(); ++i) {
    result.emplace_back(state_->entries[i].name, state_->copy(i));
  }
  return result;
}

// ---- writing ------------------------------------------------------------------------------------

namespace {

// One tensor of a file to write, as its header describes it.
struct Described {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
};

// The 8-byte length and the padded JSON header of a file holding `tensors` in this order; checks
// names (unique, not "__metadata__", UTF-8) and the header's size.
std::string header_prefix(const std::vector<Described>& tensors,
                          const std::map<std::string, std::string>& metadata,
                          const std::string& who) {
  Json header = Json::object();
  if (!metadata.empty()) {
    header[std::string(kMetadataKey)] = Json(metadata);
  }
  uint64_t offset = 0;
  for (const auto& tensor : tensors) {
    if (tensor.name == kMetadataKey) {
      throw std::invalid_argument(who + "\"__metadata__\" is reserved and cannot name a tensor");
    }
    if (header.contains(tensor.name)) {
      throw std::invalid_argument(who + "tensor name " + util::quoted(tensor.name) +
                                  " is given twice");
    }
    header[tensor.name] = {{"dtype", tensor.dtype},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + tensor.bytes}}};
    offset += tensor.bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error& error) {
    throw std::invalid_argument(who + "a tensor name or metadata string is not valid UTF-8 (" +
                                error.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes) {
    throw std::invalid_argument(who + "the header would take " + std::to_string(text.size()) +
                                " bytes, over the " + std::to_string(kSafetensorsMaxHeaderBytes) +
                                " readers accept; split the tensors over several files");
  }
  std::string prefix;
  prefix.reserve(8 + text.size());
  for (std::size_t i = 0; i < 8; ++i) {
    prefix.push_back(static_cast<char>((static_cast<uint64_t>(text.size()) >> (8U * i)) & 0xFFU));
  }
  return prefix + text;
}

std::string checked_dtype_name(at::ScalarType dtype, const std::string& name,
                               const std::string& who) {
  const std::string_view found = name_of(dtype);
  if (found.empty()) {
    throw std::invalid_argument(who + "tensor " + util::quoted(name) + ": " + no_name(dtype));
  }
  return std::string(found);
}

// The checked header and the contiguous CPU data of a file to write.
struct Plan {
  std::string prefix;  // the 8-byte length and the padded JSON header
  std::vector<at::Tensor> data;
};

Plan plan_file(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
               const std::string& who) {
  Plan plan;
  plan.data.reserve(tensors.size());
  std::vector<Described> described;
  described.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      throw std::invalid_argument(who + "tensor " + util::quoted(name) + " is undefined");
    }
    if (tensor.layout() != at::kStrided) {
      throw std::invalid_argument(who + "tensor " + util::quoted(name) +
                                  " is not strided (layout " + c10::str(tensor.layout()) +
                                  "); convert it with to_dense()");
    }
    const auto dtype = checked_dtype_name(tensor.scalar_type(), name, who);
    // Conjugate and negative views are lazy bits on the tensor: make them real values first.
    at::Tensor cpu = tensor.resolve_conj().resolve_neg().cpu().contiguous();
    described.push_back({.name = name,
                         .dtype = dtype,
                         .shape = cpu.sizes().vec(),
                         .bytes = static_cast<uint64_t>(cpu.nbytes())});
    plan.data.push_back(std::move(cpu));
  }
  plan.prefix = header_prefix(described, metadata, who);
  return plan;
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
  const Plan plan = plan_file(tensors, metadata, "d9d::state::save_safetensors: " + path + ": ");
  files::AtomicFile file(path, "d9d::state::save_safetensors");
  file.write(plan.prefix.data(), plan.prefix.size());
  for (const auto& tensor : plan.data) {
    if (tensor.nbytes() > 0) {
      file.write(tensor.const_data_ptr(), tensor.nbytes());
    }
  }
  file.commit();
}

std::string serialize_safetensors(const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  const Plan plan = plan_file(tensors, metadata, "d9d::state::serialize_safetensors: ");
  std::string bytes = plan.prefix;
  for (const auto& tensor : plan.data) {
    if (tensor.nbytes() > 0) {
      bytes.append(static_cast<const char*>(tensor.const_data_ptr()), tensor.nbytes());
    }
  }
  return bytes;
}

struct SafetensorsWriter::Impl {
  explicit Impl(const std::string& path)
      : who("d9d::state::SafetensorsWriter: " + path),
        file(path, "d9d::state::SafetensorsWriter") {}
  std::string who;  // for messages: the class and the path
  files::AtomicFile file;
  std::vector<SafetensorsEntry> entries;
  std::size_t next = 0;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata) {
  const std::string who = "d9d::state::SafetensorsWriter: " + path + ": ";
  std::vector<Described> described;
  described.reserve(entries.size());
  for (auto& entry : entries) {
    uint64_t numel = 1;
    for (const auto size : entry.shape) {
      if (size < 0) {
        throw std::invalid_argument(who + "tensor " + util::quoted(entry.name) +
                                    " has a negative size");
      }
      numel *= static_cast<uint64_t>(size);
    }
    const auto dtype = checked_dtype_name(entry.dtype, entry.name, who);
    const uint64_t bytes = numel * static_cast<uint64_t>(c10::elementSize(entry.dtype));
    described.push_back({.name = entry.name, .dtype = dtype, .shape = entry.shape, .bytes = bytes});
  }
  const auto prefix = header_prefix(described, metadata, who);  // checks before the file is made
  uint64_t offset = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    entries[i].begin = offset;
    offset += described[i].bytes;
    entries[i].end = offset;
  }
  impl_ = std::make_unique<Impl>(path);
  impl_->entries = std::move(entries);
  impl_->file.write(prefix.data(), prefix.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(std::string_view name, const at::Tensor& tensor) {
  auto& s = *impl_;
  if (s.next >= s.entries.size()) {
    throw std::logic_error(s.who + ": every tensor is written already; " + util::quoted(name) +
                           " is one too many");
  }
  const auto& entry = s.entries[s.next];
  if (name != entry.name) {
    throw std::logic_error(s.who + ": tensors go in the order given; expected " +
                           util::quoted(entry.name) + ", got " + util::quoted(name));
  }
  if (!tensor.defined() || tensor.scalar_type() != entry.dtype ||
      tensor.sizes() != at::IntArrayRef(entry.shape)) {
    throw std::invalid_argument(
        s.who + ": tensor " + util::quoted(entry.name) + " must be " +
        std::string(name_of(entry.dtype)) + " of shape " + util::shape_string(entry.shape) +
        (tensor.defined() ? ", got " + std::string(name_of(tensor.scalar_type())) + " of shape " +
                                util::shape_string(tensor.sizes().vec())
                          : ", got an undefined tensor"));
  }
  const at::Tensor cpu = tensor.resolve_conj().resolve_neg().cpu().contiguous();
  if (cpu.nbytes() > 0) {
    s.file.write(cpu.const_data_ptr(), cpu.nbytes());
  }
  ++s.next;
}

void SafetensorsWriter::commit() {
  auto& s = *impl_;
  if (s.next != s.entries.size()) {
    throw std::logic_error(s.who + ": " + std::to_string(s.entries.size() - s.next) +
                           " tensor(s) not written yet, the next is " +
                           util::quoted(s.entries[s.next].name));
  }
  s.file.commit();
}

NamedTensors load_safetensors(const std::string& path) {
  return open_safetensors_as(path, "d9d::state::load_safetensors").tensors();
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  return open_safetensors_as(path, "d9d::state::read_safetensors_metadata").metadata();
}

}  // namespace d9d::state
