// d9d/state/safetensors.hpp — write and read tensors in the safetensors file format.
//
//   d9d::state::save_safetensors("model.safetensors", {{"w", w}, {"b", b}}, {{"step", "100"}});
//   auto tensors = d9d::state::load_safetensors("model.safetensors");   // [("w", w), ("b", b)]
//   auto meta = d9d::state::read_safetensors_metadata("model.safetensors");  // {"step": "100"}
//
// The format: an 8-byte little-endian header length N; N bytes of UTF-8 JSON
// {name: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__":
// {string: string}}, padded with spaces so the data starts at a multiple of 8; then the data, each
// tensor's elements in row-major order, little-endian, at [begin, end) counted from the start of
// the data. Dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL (at::kDouble ... at::kBool).
//
// Writing makes every tensor contiguous on the CPU, lays the data out in the order given (the
// header lists the tensors in that order too), writes `<path>.tmp`, flushes it to disk and renames
// it over `path`, so a crash leaves the old file or the new one, never half of one. Reading checks
// everything before trusting it: a header length past the end of the file, bad JSON, a duplicate
// name, an unknown dtype, a negative or overflowing shape, offsets out of range, overlapping or
// leaving holes, a byte count that does not match the shape, a BOOL byte other than 0/1 — each is
// an std::runtime_error naming the file and the tensor. Tensors come back in data order (the
// order they were written in). Whole-file reads only; streaming and sharded checkpoints come later.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::state {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes `tensors` (names unique, not "__metadata__"; dtypes as in the file comment) and
/// `metadata` to `path` through `<path>.tmp`. std::invalid_argument for a bad name, an undefined
/// tensor or an unsupported dtype; std::runtime_error for an I/O failure.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Every tensor of the file (CPU, contiguous), in data order.
[[nodiscard]] NamedTensors load_safetensors(const std::string& path);

/// The file's "__metadata__" (empty when it has none); reads and checks the header only.
[[nodiscard]] std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

/// "F32", "BF16", ... for a supported dtype; std::invalid_argument otherwise.
[[nodiscard]] std::string safetensors_dtype_name(at::ScalarType dtype);

}  // namespace d9d::state
