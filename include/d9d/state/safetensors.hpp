// d9d/state/safetensors.hpp — read and write tensors in the safetensors file format.
//
//   d9d::state::save_safetensors("model.safetensors", {{"w", w}, {"b", b}}, {{"step", "100"}});
//   const d9d::state::SafetensorsFile file("model.safetensors");  // maps it, checks the header
//   at::Tensor w = file.tensor("w");                               // an owned CPU copy
//
// The format: an 8-byte little-endian header length N; N bytes of UTF-8 JSON
// {name: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__":
// {string: string}}, padded with spaces so the data starts at a multiple of 8; then the data, each
// tensor's elements in row-major order, little-endian, at [begin, end) counted from the start of
// the data. Dtypes (at::ScalarType): F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL, F8_E4M3
// (kFloat8_e4m3fn), F8_E5M2 (kFloat8_e5m2), F8_E8M0 (kFloat8_e8m0fnu), U16 U32 U64 (kUInt16 ...),
// C64 (kComplexFloat). The sub-byte F4, F6_E2M3 and F6_E3M2 have no LibTorch type: a clear error.
//
// Reading maps the file (POSIX mmap, private and copy-on-write) and checks the whole header once,
// before anything is trusted: the length (at most 100,000,000 bytes, like the Rust reader), UTF-8,
// JSON with no duplicate key at any level, the dtype, the shape (integers >= 0, product fitting in
// int64), the byte count against the shape, offsets that tile the data exactly (no overlap, hole
// or trailing byte), "__metadata__" of strings. Any problem is an std::runtime_error naming the
// reader, the file and the tensor. BOOL bytes other than 0/1 are refused when the tensor is
// materialised. Nothing is read into memory until asked: `tensor(name)` copies one tensor out of
// the mapping, `view(name)` shares it (see there). If another process truncates the file while it
// is mapped, touching the lost pages raises SIGBUS, as with every mmap reader.
//
// Writing makes every tensor contiguous on the CPU, lays the data out in the order given (the
// header lists the tensors in that order too), writes `<path>.tmp`, flushes it to disk and renames
// it over `path`, so a crash leaves the old file or the new one, never half of one. Sharded
// checkpoints (Hugging Face's model-0000i-of-0000N + index) are in safetensors_sharded.hpp.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::state {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// One tensor's checked header entry. `begin`/`end` count from the start of the data section.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;

  [[nodiscard]] uint64_t nbytes() const { return end - begin; }
};

namespace detail {
struct SafetensorsState;
}  // namespace detail

/// An open, checked safetensors file (or in-memory image). Cheap to copy (copies share the
/// mapping); all members are const and safe to call from several threads.
class SafetensorsFile {
 public:
  /// Maps `path` and checks its header; std::runtime_error "<who>: <path>: <problem>" otherwise.
  explicit SafetensorsFile(const std::string& path);

  /// The same checks on an image in memory (kept by the object); `name` stands for the path in
  /// error messages.
  [[nodiscard]] static SafetensorsFile from_bytes(std::string bytes, std::string name = "<memory>");

  /// The path (or the name given to from_bytes).
  [[nodiscard]] const std::string& path() const;
  /// The file's "__metadata__" (empty when it has none).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const;
  /// Every entry, in data order (the order of their bytes in the file).
  [[nodiscard]] const std::vector<SafetensorsEntry>& entries() const;
  /// Bytes before the data section: 8 + the header length.
  [[nodiscard]] uint64_t data_offset() const;
  /// The size of the whole file in bytes.
  [[nodiscard]] uint64_t size() const;

  [[nodiscard]] bool contains(std::string_view name) const;
  /// The entry of `name`; std::out_of_range naming the file when there is none.
  [[nodiscard]] const SafetensorsEntry& entry(std::string_view name) const;

  /// An owned, contiguous CPU tensor with a copy of the data. std::out_of_range for an unknown
  /// name; std::runtime_error for a BOOL byte other than 0/1.
  [[nodiscard]] at::Tensor tensor(std::string_view name) const;
  /// Zero-copy: a CPU tensor over the mapping, which it keeps alive (the file object may go).
  /// Writes to it are private to this process (copy-on-write), never reach the file. Falls back
  /// to a copy when the data is not aligned to the element size (the format does not promise it).
  [[nodiscard]] at::Tensor view(std::string_view name) const;
  /// Every tensor, copied, in data order.
  [[nodiscard]] NamedTensors tensors() const;
  /// Drops the mapped pages that lie wholly inside tensor `name` from this process's memory
  /// (madvise MADV_DONTNEED; a later read maps them from the file again), so that reading a large
  /// file piece by piece does not keep every piece resident. Private writes made earlier through
  /// views of it are lost in the dropped pages (not in the partial pages at its ends, shared with
  /// its neighbours): release only what nobody writes to. Does nothing and returns false while a
  /// view of `name` is alive (from any copy of this object) or for an in-memory image; true when
  /// the pages were dropped. std::out_of_range for an unknown name.
  bool release(std::string_view name) const;

 private:
  explicit SafetensorsFile(std::shared_ptr<detail::SafetensorsState> state);
  friend SafetensorsFile open_safetensors_as(const std::string& path, std::string_view who);

  std::shared_ptr<detail::SafetensorsState> state_;
};

/// Like the SafetensorsFile constructor, with `who` as the first part of error messages.
[[nodiscard]] SafetensorsFile open_safetensors_as(const std::string& path, std::string_view who);

/// Writes `tensors` (names unique, not "__metadata__"; dtypes as in the file comment; strided CPU
/// or device tensors) and `metadata` to `path` through `<path>.tmp`. std::invalid_argument for a
/// bad name, an undefined or non-strided tensor, an unsupported dtype or a header over the 100 MB
/// limit; std::runtime_error for an I/O failure.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Writes a safetensors file one tensor at a time, so only one tensor is in memory: the header
/// (from the entries' names, dtypes and shapes, in order) goes first, then write() each tensor in
/// that order, then commit() (fsync and rename over `path`; until then only `<path>.tmp` exists,
/// and it is removed when the writer goes without a commit).
///
///   d9d::state::SafetensorsWriter out(path, {{.name = "w", .dtype = at::kFloat, .shape = {2,
///   3}}}); out.write("w", w);   // std::invalid_argument on another dtype or shape out.commit();
///   // std::logic_error when a tensor is missing
class SafetensorsWriter {
 public:
  /// `entries`: name, dtype and shape of each tensor (begin/end are computed). Throws
  /// std::invalid_argument like save_safetensors before the file is created.
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  SafetensorsWriter(SafetensorsWriter&&) = delete;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = delete;

  /// The next tensor (any device; copied to the CPU as it is written).
  void write(std::string_view name, const at::Tensor& tensor);
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The bytes save_safetensors would write (same checks), for in-memory use.
[[nodiscard]] std::string serialize_safetensors(
    const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

/// Every tensor of the file (CPU, contiguous, owned), in data order.
[[nodiscard]] NamedTensors load_safetensors(const std::string& path);

/// The file's "__metadata__" (empty when it has none); checks the header, reads no data.
[[nodiscard]] std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

/// "F32", "BF16", ... for a supported dtype; std::invalid_argument otherwise.
[[nodiscard]] std::string safetensors_dtype_name(at::ScalarType dtype);

/// The largest header length readers accept (the Rust reader's limit); writers refuse more.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

}  // namespace d9d::state
