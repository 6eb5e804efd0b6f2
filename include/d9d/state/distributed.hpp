// d9d/state/distributed.hpp — save a sharded state from every rank, load it back on any layout.
//
//   namespace st = d9d::state;
//   st::save_distributed(ctx, "ckpt/step-100", {{"w", sharded_w}, {"b", plain_b}});
//   auto local = st::load_distributed("ckpt/step-100",
//                                     {{.name = "w", .layout = rows}, {.name = "b"}});
//
// Save: every shard of every tensor is written exactly once. A ShardedTensor's local piece is
// written by the rank whose coordinate is 0 on every Replicate mesh dimension (Partial: an error);
// a plain tensor by the lowest rank that passes it. Rank r writes model-rank{r}-of-{n}.safetensors;
// each piece is stored under "<name>" when it covers the whole tensor, else "<name>@<o0>,<o1>..."
// (its offsets). Rank 0 gathers the descriptions of every piece and writes
// model.safetensors.index.json: "metadata.total_size", "weight_map" (piece -> file) and
// "d9d_pieces" (piece -> {name, shape (global), offsets, lengths}), so stages of a pipeline merge
// into one index.
//
// Atomic protocol (crash table in docs/state.md): rank 0 empties `<dir>.partial`; every rank writes
// its file there (tmp + fsync + rename); rank 0 gathers, writes the index (tmp + fsync + rename)
// and fsyncs `<dir>.partial`; rank 0 renames `<dir>` -> `<dir>.old`, `<dir>.partial` -> `<dir>`,
// fsyncs the parent, removes `<dir>.old`. After each of these steps the ranks agree on errors
// (d9d::raise_if_any_failed): an error on any rank is thrown on every rank at once, naming that
// rank, and nothing more is done. load_distributed reads `<dir>.old` when `<dir>` is missing (a
// crash between the two renames), so some complete checkpoint is always loadable.
//
// Load: each rank reads, from the mapped files, only the pieces overlapping its own shard of each
// target (the target's mesh and placements may differ from those at save time) and copies the
// overlaps into its local tensor: bit-identical, any world size. Compiled in
// src/state/distributed.cpp as part of //:d9d (it needs the core, which //src/state does not).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/distributed_context.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/mapper_distributed.hpp>

namespace d9d::state {

/// A tensor to save: this rank's shard of a ShardedTensor, or a plain (replicated) tensor.
using DistributedTensor = std::variant<ShardedTensor, at::Tensor>;
/// Named tensors to save; the names must be unique on a rank (ranks may pass different names,
/// e.g. pipeline stages).
using DistributedState = std::vector<std::pair<std::string, DistributedTensor>>;

/// Options of save_distributed.
struct DistributedSaveOptions {
  /// A rank-0 progress line (one step per tensor that rank 0 writes, then the total of all ranks).
  bool progress = false;
  /// Called on every rank after its file is complete and before the checkpoint is committed
  /// (tests kill a rank here to check that the previous checkpoint survives).
  std::function<void()> before_commit = {};
};

/// One tensor to load: its name and its layout on this rank's mesh (none: the full tensor).
struct DistributedLoadTarget {
  std::string name;
  std::optional<ShardLayout> layout = std::nullopt;
};

/// The name of the index file of a distributed checkpoint.
inline constexpr const char* kDistributedIndexName = "model.safetensors.index.json";

/// Saves `state` into directory `dir` (collective over every rank of `ctx`; see the file
/// comment for the layout and the atomic protocol). A previous checkpoint in `dir` stays loadable
/// until the new one is complete. Errors are thrown on every rank alike, naming the rank that
/// failed: std::invalid_argument for a Partial tensor or a piece written twice,
/// std::runtime_error for I/O (naming the file).
void save_distributed(const DistributedContext& ctx, const std::string& dir,
                      const DistributedState& state, const DistributedSaveOptions& options = {});

/// Loads `targets` from a checkpoint of save_distributed (collective only in that every rank
/// reads; no communication). Returns each target's local tensor on the CPU: this rank's shard
/// under its layout, or the full tensor. Reads `<dir>.old` when `dir` is missing (an interrupted
/// commit). std::invalid_argument naming the tensor when it is missing or not fully covered.
[[nodiscard]] std::map<std::string, at::Tensor> load_distributed(
    const std::string& dir, const std::vector<DistributedLoadTarget>& targets,
    bool progress = false);

}  // namespace d9d::state
