// d9d/state/distributed.hpp — save a sharded state from every rank, load it back on any layout.
//
//   namespace st = d9d::state;
//   st::save_distributed(ctx, "ckpt/step-100", {{"w", sharded_w}, {"b", plain_b}});
//   auto local = st::load_distributed(ctx, "ckpt/step-100",
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
// Atomic protocol (crash table in docs/state.md): rank 0 empties `<dir>.partial`; barrier; every
// rank writes its file there (tmp + fsync + rename); rank 0 gathers, writes the index (tmp + fsync
// + rename); barrier; rank 0 renames `<dir>` -> `<dir>.old`, `<dir>.partial` -> `<dir>`, removes
// `<dir>.old`; barrier. load_distributed reads `<dir>.old` when `<dir>` is missing (a crash
// between the two renames), so some complete checkpoint is always loadable.
//
// Load: each rank reads, from the mapped files, only the pieces overlapping its own shard of each
// target (the target's mesh and placements may differ from those at save time) and copies the
// overlaps into its local tensor: bit-identical, any world size. Header-only: it needs //:d9d (the
// core), which the state library does not depend on (as mapper_distributed.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <fcntl.h>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/core/object_collectives.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/state/mapper_distributed.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/track/progress.hpp>
#include <d9d/util/files.hpp>

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

namespace detail {

/// One stored piece of a tensor: which part of `name` it holds, where.
struct DistPiece {
  std::string key;
  std::string name;
  std::string file;
  std::vector<int64_t> shape;
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  int64_t nbytes = 0;
};

inline void to_json(nlohmann::json& j, const DistPiece& p) {
  j = nlohmann::json{{"key", p.key},      {"name", p.name},       {"file", p.file},
                     {"shape", p.shape},  {"offsets", p.offsets}, {"lengths", p.lengths},
                     {"nbytes", p.nbytes}};
}

inline void from_json(const nlohmann::json& j, DistPiece& p) {
  j.at("key").get_to(p.key);
  j.at("name").get_to(p.name);
  j.at("file").get_to(p.file);
  j.at("shape").get_to(p.shape);
  j.at("offsets").get_to(p.offsets);
  j.at("lengths").get_to(p.lengths);
  j.at("nbytes").get_to(p.nbytes);
}

/// Writes `text` to `path` through `<path>.tmp`, flushed to disk, then renamed.
inline void write_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);  // NOLINT
  if (fd < 0) {
    throw std::runtime_error("d9d::state::save_distributed: cannot create '" + tmp + "'");
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("d9d::state::save_distributed: cannot write '" + tmp + "'");
    }
    done += static_cast<std::size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) {
    throw std::runtime_error("d9d::state::save_distributed: cannot flush '" + tmp + "'");
  }
  files::rename(tmp, path);
}

inline std::string read_text(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // NOLINT
  if (fd < 0) {
    throw std::runtime_error("d9d::state::load_distributed: cannot open '" + path +
                             "'. Fix: pass the directory of a checkpoint written by "
                             "save_distributed");
  }
  std::string out;
  char buf[65536];  // NOLINT(*-avoid-c-arrays)
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      ::close(fd);
      throw std::runtime_error("d9d::state::load_distributed: cannot read '" + path + "'");
    }
    if (n == 0) {
      break;
    }
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

/// True when this rank writes its local piece of `t`: coordinate 0 on every Replicate dimension.
inline bool owns_piece(const std::string& name, const ShardedTensor& t) {
  for (std::size_t i = 0; i < t.placements().size(); ++i) {
    if (std::holds_alternative<Partial>(t.placements()[i])) {
      throw std::invalid_argument("d9d::state::save_distributed: tensor '" + name +
                                  "' is Partial on mesh dimension '" + t.dims()[i] +
                                  "'. Fix: redistribute it to Replicate or Shard before saving");
    }
    if (std::holds_alternative<Replicate>(t.placements()[i]) &&
        t.mesh().coordinate(t.domain(), t.dims()[i]) != 0) {
      return false;
    }
  }
  return true;
}

inline std::string piece_key(const std::string& name, const std::vector<int64_t>& offsets,
                             const std::vector<int64_t>& lengths,
                             const std::vector<int64_t>& shape) {
  if (offsets == std::vector<int64_t>(offsets.size(), 0) && lengths == shape) {
    return name;
  }
  std::string key = name + "@";
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    key += (i == 0 ? "" : ",") + std::to_string(offsets[i]);
  }
  return key;
}

}  // namespace detail

/// Saves `state` into directory `dir` (collective over every rank of `ctx`; see the file
/// comment for the layout and the atomic protocol). A previous checkpoint in `dir` stays loadable
/// until the new one is complete. std::invalid_argument for a Partial tensor or a duplicate name;
/// std::runtime_error for I/O (naming the file).
inline void save_distributed(const DistributedContext& ctx, const std::string& dir,
                             const DistributedState& state,
                             const DistributedSaveOptions& options = {}) {
  const std::string partial = dir + ".partial";
  const std::string old = dir + ".old";
  const int rank = ctx.rank();
  const int world = ctx.world_size();
  // Plain tensors: the lowest rank that passes a name writes it.
  std::vector<std::string> plain_names;
  for (const auto& [name, tensor] : state) {
    if (std::holds_alternative<at::Tensor>(tensor)) {
      plain_names.push_back(name);
    }
  }
  const auto all_plain = all_gather_object(ctx.world(), plain_names);
  if (rank == 0) {
    files::remove_tree(partial);
    files::create_directories(partial, "d9d::state::save_distributed");
  }
  ctx.barrier();

  const std::string file =
      "model-rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
  NamedTensors pieces_data;
  std::vector<detail::DistPiece> pieces;
  std::optional<track::ProgressBar> bar;
  if (options.progress && rank == 0) {
    bar.emplace(static_cast<int64_t>(state.size()), "save " + dir);
  }
  int64_t step = 0;
  for (const auto& [name, tensor] : state) {
    detail::DistPiece p{.key = {}, .name = name, .file = file};
    at::Tensor data;
    if (const auto* sharded = std::get_if<ShardedTensor>(&tensor)) {
      if (!detail::owns_piece(name, *sharded)) {
        continue;
      }
      p.shape = sharded->global_shape();
      for (const auto& r : sharded->local_ranges()) {
        p.offsets.push_back(r.offset);
        p.lengths.push_back(r.length);
      }
      data = sharded->local();
    } else {
      bool lower = false;
      for (int r = 0; r < rank && !lower; ++r) {
        lower = std::find(all_plain[r].begin(), all_plain[r].end(), name) != all_plain[r].end();
      }
      if (lower) {
        continue;
      }
      data = std::get<at::Tensor>(tensor);
      p.shape = data.sizes().vec();
      p.offsets.assign(p.shape.size(), 0);
      p.lengths = p.shape;
    }
    if (std::find(p.lengths.begin(), p.lengths.end(), 0) != p.lengths.end() && !p.shape.empty()) {
      continue;  // an empty shard holds nothing
    }
    p.key = detail::piece_key(name, p.offsets, p.lengths, p.shape);
    p.nbytes = static_cast<int64_t>(data.nbytes());
    pieces_data.emplace_back(p.key, data);
    pieces.push_back(std::move(p));
    if (bar) {
      bar->update(++step);
    }
  }
  save_safetensors(files::join(partial, file), pieces_data, {{"format", "pt"}});
  if (options.before_commit) {
    options.before_commit();
  }
  const auto gathered = gather_object(ctx.world(), pieces, 0);
  if (rank == 0) {
    nlohmann::json index;
    int64_t total = 0;
    nlohmann::json weight_map = nlohmann::json::object();
    nlohmann::json described = nlohmann::json::object();
    for (const auto& per_rank : gathered) {
      for (const auto& p : per_rank) {
        if (weight_map.contains(p.key)) {
          throw std::invalid_argument("d9d::state::save_distributed: piece '" + p.key +
                                      "' written twice (in " + p.file + " and " +
                                      weight_map[p.key].get<std::string>() +
                                      "). Fix: give every tensor one layout on all ranks");
        }
        weight_map[p.key] = p.file;
        described[p.key] = p;
        total += p.nbytes;
      }
    }
    index["metadata"] = {{"total_size", total}, {"format", "d9d-distributed"}};
    index["weight_map"] = weight_map;
    index["d9d_pieces"] = described;
    detail::write_file_durably(files::join(partial, kDistributedIndexName), index.dump(1));
    if (bar) {
      bar->write("saved " + std::to_string(total) + " bytes from " + std::to_string(world) +
                 " ranks");
      bar->finish();
    }
  }
  ctx.barrier();
  if (rank == 0) {
    files::remove_tree(old);
    if (files::exists(dir)) {
      files::rename(dir, old);
    }
    files::rename(partial, dir);
    files::remove_tree(old);
  }
  ctx.barrier();
}

/// Loads `targets` from a checkpoint of save_distributed (collective only in that every rank
/// reads; no communication). Returns each target's local tensor on the CPU: this rank's shard
/// under its layout, or the full tensor. Reads `<dir>.old` when `dir` is missing (an interrupted
/// commit). std::invalid_argument naming the tensor when it is missing or not fully covered.
[[nodiscard]] inline std::map<std::string, at::Tensor> load_distributed(
    const std::string& dir, const std::vector<DistributedLoadTarget>& targets,
    bool progress = false) {
  const std::string root = files::exists(dir) || !files::exists(dir + ".old") ? dir : dir + ".old";
  const auto index =
      nlohmann::json::parse(detail::read_text(files::join(root, kDistributedIndexName)));
  std::map<std::string, std::vector<detail::DistPiece>> by_name;
  for (const auto& [key, value] : index.at("d9d_pieces").items()) {
    auto p = value.get<detail::DistPiece>();
    by_name[p.name].push_back(std::move(p));
  }
  std::map<std::string, SafetensorsFile> opened;
  std::map<std::string, at::Tensor> out;
  std::optional<track::ProgressBar> bar;
  if (progress) {
    bar.emplace(static_cast<int64_t>(targets.size()), "load " + dir);
  }
  int64_t step = 0;
  for (const auto& target : targets) {
    const auto it = by_name.find(target.name);
    if (it == by_name.end()) {
      throw std::invalid_argument("d9d::state::load_distributed: no tensor '" + target.name +
                                  "' in " + root);
    }
    const auto& shape = it->second.front().shape;
    std::vector<ShardRange> want;
    if (target.layout) {
      const auto& l = *target.layout;
      want = ShardedTensor::distribute(at::empty(shape, at::TensorOptions().device(at::kMeta)),
                                       l.mesh, l.domain, l.dims, l.placements)
                 .local_ranges();
    } else {
      for (const int64_t s : shape) {
        want.push_back({.offset = 0, .length = s});
      }
    }
    std::vector<int64_t> local_shape;
    for (const auto& r : want) {
      local_shape.push_back(r.length);
    }
    at::Tensor local;
    int64_t covered = 0;
    for (const auto& p : it->second) {
      auto fit = opened.find(p.file);
      if (fit == opened.end()) {
        fit = opened
                  .emplace(p.file, open_safetensors_as(files::join(root, p.file),
                                                       "d9d::state::load_distributed"))
                  .first;
      }
      at::Tensor src = fit->second.view(p.key);
      at::Tensor dst;
      if (!local.defined()) {
        local = at::empty(local_shape, src.options());
      }
      dst = local;
      bool empty = false;
      for (std::size_t d = 0; d < want.size(); ++d) {
        const int64_t lo = std::max(want[d].offset, p.offsets[d]);
        const int64_t hi = std::min(want[d].offset + want[d].length, p.offsets[d] + p.lengths[d]);
        if (hi <= lo) {
          empty = true;
          break;
        }
        const auto dim = static_cast<int64_t>(d);
        src = src.narrow(dim, lo - p.offsets[d], hi - lo);
        dst = dst.narrow(dim, lo - want[d].offset, hi - lo);
      }
      if (!empty) {
        dst.copy_(src);
        covered += dst.numel();
      }
    }
    if (!local.defined()) {
      throw std::invalid_argument("d9d::state::load_distributed: tensor '" + target.name +
                                  "' has no stored piece in " + root);
    }
    if (covered != local.numel()) {
      throw std::invalid_argument("d9d::state::load_distributed: the pieces of '" + target.name +
                                  "' in " + root + " cover " + std::to_string(covered) + " of " +
                                  std::to_string(local.numel()) + " elements of this rank's shard");
    }
    out.emplace(target.name, local);
    if (bar) {
      bar->update(++step);
    }
  }
  if (bar) {
    bar->finish();
  }
  return out;
}

}  // namespace d9d::state
