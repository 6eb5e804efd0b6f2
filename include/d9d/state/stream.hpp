// d9d/state/stream.hpp — read a checkpoint through a state mapper, one group at a time.
//
//   auto source = d9d::state::StateSource::open("ckpt");  // a file, or a directory with an index
//   auto stats = d9d::state::stream_state(source, mapper, on_tensor);  // (name, tensor) each
//   d9d::state::load_into(*model, source, mapper);  // into parameters and buffers by name
//
// The stream checks the mapper against the source's keys first (missing or unused input: the
// errors of d9d::state::validate) and the shapes the groups produce from the headers alone
// (infer_shapes), then plans: each group needs the files holding its inputs;
// groups are ordered by the first file they need (then by where their data starts), so each file
// is opened once and closed after the last group needing it. Then, group by group: the inputs are
// mapped from the file without copying (SafetensorsFile::view), the group is applied, the outputs
// that still share memory with the file or with a larger tensor are copied into tensors of their
// own, the inputs and their mapped pages are dropped (SafetensorsFile::release), and the callback
// gets every output of the group. So the stream holds about one group's tensors at a time, never
// the whole checkpoint, and a leaf that keeps a slice (d9d::state::distribute) copies only that
// slice. StreamStats reports what it did.
//
// The plan is a pure function of the source and the mapper, so ranks that stream the same
// checkpoint through the same mapper apply the same groups in the same order, which groups with
// collectives (gather_full) rely on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/state/mapper.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace d9d::state {

/// The tensors a stream can read: one safetensors file, or a sharded checkpoint (index + files,
/// each opened only when a group needs it). Cheap to copy.
class StateSource {
 public:
  /// `path` is a directory holding model.safetensors.index.json (a sharded checkpoint) or
  /// model.safetensors, or a safetensors file. std::runtime_error naming the path otherwise.
  [[nodiscard]] static StateSource open(const std::string& path);
  /// An already opened file (from a path or SafetensorsFile::from_bytes).
  [[nodiscard]] static StateSource from_file(SafetensorsFile file);
  /// A sharded checkpoint by its index (load_safetensors_index).
  [[nodiscard]] static StateSource from_index(const SafetensorsIndex& index);

  /// Every tensor name the source holds, sorted.
  [[nodiscard]] const std::vector<std::string>& keys() const { return keys_; }
  /// The files, in the order of file_of (sorted by name for a sharded checkpoint).
  [[nodiscard]] const std::vector<std::string>& files() const { return files_; }
  /// The index into files() of the file holding `key`; std::out_of_range when none does.
  [[nodiscard]] std::size_t file_of(std::string_view key) const;
  /// File `file` opened (or the file given to from_file): std::runtime_error when it is bad.
  [[nodiscard]] SafetensorsFile open_file(std::size_t file) const;
  /// Where `key`'s data starts in its file when that file is already open, else 0 (for ordering).
  [[nodiscard]] uint64_t offset_hint(std::string_view key) const;

 private:
  StateSource() = default;

  std::vector<std::string> keys_;
  std::vector<std::size_t> key_file_;  // parallel to keys_
  std::vector<std::string> files_;
  std::optional<SafetensorsFile> opened_;  // from_file / a single file: already open
};

/// What a stream did. Bytes count tensor data (nbytes), not the mapping of the file.
struct StreamStats {
  /// Groups applied (groups without outputs are skipped: nothing of theirs is read).
  std::size_t groups = 0;
  /// Files opened (each at most once).
  std::size_t files_opened = 0;
  /// Input tensors read, and their bytes.
  std::size_t tensors_read = 0;
  uint64_t bytes_read = 0;
  /// Inputs whose mapped pages were dropped after their group (SafetensorsFile::release); fewer
  /// than tensors_read when something still holds a view (a from_file source's owner, say).
  std::size_t tensors_released = 0;
  /// Outputs handed to the callback, and their bytes.
  std::size_t outputs = 0;
  uint64_t output_bytes = 0;
  /// Output bytes copied out of the file or out of larger tensors (views made into own tensors).
  uint64_t copied_bytes = 0;
  /// The most tensor bytes the stream held at once: one group's inputs plus its outputs (the
  /// intermediates inside a group's function come and go within it; what the callback keeps is
  /// the caller's).
  uint64_t peak_bytes = 0;
};

/// Options of stream_state.
struct StreamOptions {
  /// Accept source keys that no group reads (default: the "unused input" error of validate).
  bool allow_unused_inputs = false;
  /// Run infer_shapes before reading, so that a group's shape errors come before any data is read.
  bool check_shapes = true;
};

/// The dtype and shape of a tensor, known without its data.
struct TensorSpec {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;

  bool operator==(const TensorSpec&) const = default;
};

/// The dtypes and shapes of the outputs, derived from the source's headers alone: every group with
/// outputs for which Mapper::runs_on_meta holds is applied to meta tensors (no data, no
/// allocation), so its errors (tensors that do not stack, a squeeze of a dimension that is not 1,
/// ...) come now, as std::invalid_argument from apply. Outputs of the other groups are absent.
/// Checks the mapper's inputs first (validate's missing-input error; unused inputs are allowed
/// here). Opens each file it needs to read its header.
[[nodiscard]] std::map<std::string, TensorSpec> infer_shapes(const StateSource& source,
                                                             const Mapper& mapper);

/// Gets each output: its name and an owned tensor (no longer backed by the file).
using StreamCallback = std::function<void(const std::string& name, const at::Tensor& tensor)>;

/// Streams `source` through `mapper` (see the file comment); the callback gets every output of a
/// group as soon as the group is complete. Errors: those of validate and of infer_shapes (unless
/// options.check_shapes is false), before any read;
/// std::runtime_error for a bad or missing file or a tensor missing from the file the index names;
/// those of Mapper::apply; whatever the callback throws (the stream stops there).
StreamStats stream_state(const StateSource& source, const Mapper& mapper,
                         const StreamCallback& callback, const StreamOptions& options = {});

/// Options of load_into.
struct LoadOptions {
  /// Accept source keys that no group reads.
  bool allow_unused_inputs = false;
  /// Accept module parameters and buffers that no group produces (they keep their values).
  bool allow_missing = false;
};

/// Streams `source` through `mapper` into `module`'s parameters and buffers (recursively, by their
/// dotted names), copying each output in place (dtype and device converted as Tensor::copy_ does;
/// without recording gradients). Before anything is read, std::invalid_argument for an output the
/// module has no parameter or buffer for ("extra"), unless allowed for a parameter or buffer no
/// group produces ("missing"), naming the keys, and for an output whose shape (from infer_shapes)
/// differs from its target's, naming both shapes. Outputs of groups that cannot run on meta
/// tensors are shape-checked when they arrive (the targets loaded before keep their new values).
/// For a parallelised model, map with distribute (mapper_distributed.hpp) so each rank reads and
/// copies only its own shards.
StreamStats load_into(torch::nn::Module& module, const StateSource& source, const Mapper& mapper,
                      const LoadOptions& options = {});

}  // namespace d9d::state
