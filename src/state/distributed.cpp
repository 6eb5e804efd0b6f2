// d9d/state/distributed.cpp — distributed save (error agreement, fsyncs, atomic commit) and
// resharded load (see the header for the contract).
#include <algorithm>
#include <cstdint>
#include <exception>
#include <fcntl.h>
#include <optional>
#include <stdexcept>
#include <unistd.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/object_collectives.hpp>
#include <d9d/state/distributed.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/progress.hpp>

namespace d9d::state {
namespace {

constexpr const char* kSaveWho = "d9d::state::save_distributed";

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

void to_json(nlohmann::json& j, const DistPiece& p) {
  j = nlohmann::json{{"key", p.key},      {"name", p.name},       {"file", p.file},
                     {"shape", p.shape},  {"offsets", p.offsets}, {"lengths", p.lengths},
                     {"nbytes", p.nbytes}};
}

void from_json(const nlohmann::json& j, DistPiece& p) {
  j.at("key").get_to(p.key);
  j.at("name").get_to(p.name);
  j.at("file").get_to(p.file);
  j.at("shape").get_to(p.shape);
  j.at("offsets").get_to(p.offsets);
  j.at("lengths").get_to(p.lengths);
  j.at("nbytes").get_to(p.nbytes);
}

std::string read_text(const std::string& path) {
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
bool owns_piece(const std::string& name, const ShardedTensor& t) {
  for (std::size_t i = 0; i < t.placements().size(); ++i) {
    if (std::holds_alternative<Partial>(t.placements()[i])) {
      throw std::invalid_argument(std::string(kSaveWho) + ": tensor '" + name +
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

std::string piece_key(const std::string& name, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& lengths, const std::vector<int64_t>& shape) {
  if (offsets == std::vector<int64_t>(offsets.size(), 0) && lengths == shape) {
    return name;
  }
  std::string key = name + "@";
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    key += (i == 0 ? "" : ",") + std::to_string(offsets[i]);
  }
  return key;
}

/// Runs `fn` (this rank's part of a step), then agrees with every rank: all throw if any failed.
template <class Fn>
void step_agreed(const DistributedContext& ctx, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  raise_if_any_failed(ctx.world(), error, kSaveWho);
}

}  // namespace

void save_distributed(const DistributedContext& ctx, const std::string& dir,
                      const DistributedState& state, const DistributedSaveOptions& options) {
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

  // 1. A fresh <dir>.partial.
  step_agreed(ctx, [&] {
    if (rank == 0) {
      files::remove_tree(partial);
      files::create_directories(partial, kSaveWho);
    }
  });

  // 2. Every rank's file, flushed to disk (save_safetensors: tmp, fsync, rename).
  const std::string file =
      "model-rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
  std::vector<DistPiece> pieces;
  std::optional<util::ProgressBar> bar;
  step_agreed(ctx, [&] {
    NamedTensors pieces_data;
    if (options.progress && rank == 0) {
      bar.emplace(static_cast<int64_t>(state.size()), "save " + dir);
    }
    int64_t step = 0;
    for (const auto& [name, tensor] : state) {
      DistPiece p{.key = {}, .name = name, .file = file, .shape = {}, .offsets = {}, .lengths = {}};
      at::Tensor data;
      if (const auto* sharded = std::get_if<ShardedTensor>(&tensor)) {
        if (!owns_piece(name, *sharded)) {
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
      p.key = piece_key(name, p.offsets, p.lengths, p.shape);
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
  });

  // 3. The index, then <dir>.partial's entries flushed: the whole checkpoint is on disk.
  const auto gathered = gather_object(ctx.world(), pieces, 0);
  step_agreed(ctx, [&] {
    if (rank != 0) {
      return;
    }
    nlohmann::json index;
    int64_t total = 0;
    nlohmann::json weight_map = nlohmann::json::object();
    nlohmann::json described = nlohmann::json::object();
    for (const auto& per_rank : gathered) {
      for (const auto& p : per_rank) {
        if (weight_map.contains(p.key)) {
          throw std::invalid_argument(std::string(kSaveWho) + ": piece '" + p.key +
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
    const std::string text = index.dump(1);
    files::AtomicFile out(files::join(partial, kDistributedIndexName), kSaveWho);
    out.write(text.data(), text.size());
    out.commit();
    files::sync_directory(partial);
    if (bar) {
      bar->write("saved " + std::to_string(total) + " bytes from " + std::to_string(world) +
                 " ranks");
      bar->finish();
    }
  });

  // 4. The commit: two renames, each made durable by flushing the parent directory.
  step_agreed(ctx, [&] {
    if (rank != 0) {
      return;
    }
    const std::string parent = files::parent(dir);
    files::remove_tree(old);
    if (files::exists(dir)) {
      files::rename(dir, old);
    }
    files::rename(partial, dir);
    files::sync_directory(parent);
    files::remove_tree(old);
    files::sync_directory(parent);
  });
}

std::map<std::string, at::Tensor> load_distributed(
    const std::string& dir, const std::vector<DistributedLoadTarget>& targets, bool progress) {
  const std::string root = files::exists(dir) || !files::exists(dir + ".old") ? dir : dir + ".old";
  const auto index = nlohmann::json::parse(read_text(files::join(root, kDistributedIndexName)));
  std::map<std::string, std::vector<DistPiece>> by_name;
  for (const auto& [key, value] : index.at("d9d_pieces").items()) {
    auto p = value.get<DistPiece>();
    by_name[p.name].push_back(std::move(p));
  }
  std::map<std::string, SafetensorsFile> opened;
  std::map<std::string, at::Tensor> out;
  std::optional<util::ProgressBar> bar;
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
    local_shape.reserve(want.size());
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
