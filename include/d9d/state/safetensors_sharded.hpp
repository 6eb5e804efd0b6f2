// d9d/state/safetensors_sharded.hpp — checkpoints split over several safetensors files, in the
// layout Hugging Face uses (transformers' save_pretrained / from_pretrained read it as is).
//
//   d9d::state::save_safetensors_sharded("ckpt", tensors, 5'000'000'000);  // 5 GB per shard
//   auto index = d9d::state::load_safetensors_index("ckpt");                // which file holds
//   what auto some = d9d::state::load_safetensors_sharded("ckpt", {"lm_head.weight"});
//
// The directory holds model-00001-of-0000N.safetensors ... model-0000N-of-0000N.safetensors and
// model.safetensors.index.json = {"metadata": {"total_size": <bytes of tensor data>},
// "weight_map": {tensor name: file name}}. Tensors go to shards in the order given, a new shard
// starting when the next tensor would take the current one past `max_shard_bytes` (tensor data
// bytes, as Hugging Face counts them); a tensor larger than the limit gets a shard of its own.
// Always this layout, also for a single shard (Hugging Face would write model.safetensors then).
//
// Writing is crash-safe in this order: the old index is removed first (so no index ever points at
// half-rewritten shards), each shard is written to `<name>.tmp`, fsynced and renamed, the index is
// written the same way last, then shards of an earlier save with another shard count
// (model-*-of-*.safetensors not in the new index) are deleted and the directory is fsynced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <d9d/state/safetensors.hpp>

namespace d9d::state {

/// What model.safetensors.index.json says.
struct SafetensorsIndex {
  std::string dir;
  /// "metadata.total_size" (0 when absent); informational, not checked against the shards.
  uint64_t total_size = 0;
  /// Tensor name -> shard file name (a plain name inside `dir`).
  std::map<std::string, std::string, std::less<>> weight_map;

  /// The shard file names, sorted, each once.
  [[nodiscard]] std::vector<std::string> files() const;
  /// `dir`/file of `name`; std::out_of_range when the index does not list it.
  [[nodiscard]] std::string path_of(std::string_view name) const;
};

/// "model-00002-of-00005.safetensors" for (2, 5): Hugging Face's shard name (1-based).
[[nodiscard]] std::string safetensors_shard_name(std::size_t shard, std::size_t shards);

/// The index file's name inside a checkpoint directory: "model.safetensors.index.json".
inline constexpr std::string_view kSafetensorsIndexName = "model.safetensors.index.json";

/// Writes `tensors` as shards of at most `max_shard_bytes` data bytes each (save_safetensors's
/// rules for names and dtypes; `metadata` goes into every shard) and the index, into `dir`
/// (created when missing). Returns the index written. std::invalid_argument for bad inputs
/// (checked before any file is touched) or max_shard_bytes == 0; std::runtime_error for I/O.
SafetensorsIndex save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                          uint64_t max_shard_bytes,
                                          const std::map<std::string, std::string>& metadata = {});

/// Reads and checks `dir`/model.safetensors.index.json: an object with a "weight_map" object of
/// string file names (plain names: no '/', not "." or ".."), an optional "metadata" object with
/// an optional integer "total_size", no duplicate keys. std::runtime_error naming the file.
[[nodiscard]] SafetensorsIndex load_safetensors_index(const std::string& dir);

/// Every shard of `index`, opened (headers checked, no tensor data read), in index.files() order;
/// checks that the shards hold exactly the tensors the index maps to them. std::runtime_error
/// starting with `who` otherwise. For reading tensor by tensor from the mapped shards
/// (SafetensorsFile::view / release) with bounded memory.
[[nodiscard]] std::vector<SafetensorsFile> open_safetensors_shards(
    const SafetensorsIndex& index, std::string_view who = "d9d::state::open_safetensors_shards");

/// Every tensor of the checkpoint (owned CPU copies), shard by shard in file-name order, data
/// order within a shard. Checks that the shards hold exactly the tensors the index maps to them.
[[nodiscard]] NamedTensors load_safetensors_sharded(const std::string& dir);

/// The tensors named, in the order asked; each shard is opened once and only the named tensors
/// are read. std::out_of_range for a name the index does not list; std::runtime_error when its
/// shard is bad or does not hold it.
[[nodiscard]] NamedTensors load_safetensors_sharded(const std::string& dir,
                                                    const std::vector<std::string>& names);

}  // namespace d9d::state
