// d9d/train/checkpoint.cpp — training checkpoints: snapshot, background write, atomic completion.
#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/checkpoint.hpp>
#include <d9d/util/files.hpp>

namespace d9d::detail {
namespace {

constexpr const char* kWho = "d9d checkpoint";

// Writes `text` to `path` through a temporary file and a rename (fsynced).
void write_atomically(const std::string& path, const std::string& text) {
  files::AtomicFile file(path, kWho);
  file.write(text.data(), text.size());
  file.commit();
}

std::string step_name(int64_t step) { return "step-" + std::to_string(step); }

// "step-<digits>.tmp": what a save leaves behind when a crash interrupts it.
bool is_step_tmp(const std::string& name) {
  constexpr std::string_view kHead = "step-";
  constexpr std::string_view kTail = ".tmp";
  if (name.size() <= kHead.size() + kTail.size() || name.rfind(kHead, 0) != 0 ||
      name.compare(name.size() - kTail.size(), kTail.size(), kTail) != 0) {
    return false;
  }
  const auto digits = name.substr(kHead.size(), name.size() - kHead.size() - kTail.size());
  return std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Runs `fn` (this rank's part of a collective step), then every rank throws if any rank failed.
template <class Fn>
void agreed(const DistributedContext& context, const std::string& who, Fn&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  raise_if_any_failed(context.world(), error, who);
}

torch::optim::AdamWParamState* adamw_state(const torch::optim::Optimizer& optimizer,
                                           const at::Tensor& param) {
  const auto& states = optimizer.state();
  const auto found = states.find(param.unsafeGetTensorImpl());
  if (found == states.end()) {
    return nullptr;
  }
  auto* state = dynamic_cast<torch::optim::AdamWParamState*>(found->second.get());
  if (state == nullptr) {
    throw std::logic_error(std::string(kWho) + ": the optimizer is not AdamW");
  }
  return state;
}

at::Tensor host_copy(const at::Tensor& t) {
  return t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

std::string join_numbers(const std::vector<int64_t>& values) {
  std::string out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    out += (i > 0 ? "," : "") + std::to_string(values[i]);
  }
  return out;
}

std::vector<int64_t> parse_numbers(const std::string& text) {
  std::vector<int64_t> out;
  std::size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    const auto comma = text.find(',', start);
    out.push_back(std::stoll(text.substr(start, comma - start)));
    if (comma == std::string::npos) {
      break;
    }
    start = comma + 1;
  }
  return out;
}

// The ranges of a whole tensor of `shape`: offset 0, the full length, per dim.
std::vector<ShardRange> whole_ranges(at::IntArrayRef shape) {
  std::vector<ShardRange> whole;
  for (const auto size : shape) {
    whole.push_back({.offset = 0, .length = size});
  }
  return whole;
}

// Where this rank's part of a record sits in the whole parameter: offset and length per dim.
std::vector<ShardRange> local_ranges(const parallel::ParameterRecord& record,
                                     const DeviceMesh& mesh) {
  if (record.sharded_dims().empty()) {
    return whole_ranges(record.global_shape);
  }
  return record.sharded(mesh).local_ranges();
}

// One rank of each group of replicas writes a record's part: coordinate 0 on every mesh dim the
// record is replicated on.
bool writes(const parallel::ParameterRecord& record, const DeviceMesh& mesh) {
  for (std::size_t i = 0; i < record.dims.size(); ++i) {
    if (std::holds_alternative<Replicate>(record.placements[i]) &&
        mesh.coordinate(record.domain, record.dims[i]) != 0) {
      return false;
    }
  }
  return true;
}

// One rank per pipeline stage writes the model's buffers: coordinate 0 on every regular mesh dim
// but pp (a stage's buffers are the same on all its ranks).
bool writes_buffers(const DeviceMesh& mesh) {
  const auto dims = DeviceMesh::layout(mesh.shape(), MeshDomain::regular);
  const auto coordinates = mesh.coordinates(MeshDomain::regular);
  for (std::size_t i = 0; i < dims.size() && i < coordinates.size(); ++i) {
    if (dims[i].name != "pp" && coordinates[i] != 0) {
      return false;
    }
  }
  return true;
}

// The stored key of a part: "<prefix>" when it is the whole tensor, else "<prefix>@<offsets>".
std::string piece_key(const std::string& prefix, const std::vector<ShardRange>& ranges,
                      const std::vector<int64_t>& shape) {
  std::vector<int64_t> offsets;
  bool whole = true;
  for (std::size_t d = 0; d < ranges.size(); ++d) {
    offsets.push_back(ranges[d].offset);
    whole = whole && ranges[d].offset == 0 && ranges[d].length == shape[d];
  }
  return whole ? prefix : prefix + "@" + join_numbers(offsets);
}

// The stored parts of every tensor of a checkpoint, by the name before '@'.
struct Piece {
  const state::SafetensorsFile* file = nullptr;
  std::string key;
  std::vector<int64_t> offsets;  // empty: the whole tensor
};
using PieceIndex = std::map<std::string, std::vector<Piece>>;

PieceIndex index_pieces(const std::vector<state::SafetensorsFile>& files) {
  PieceIndex index;
  for (const auto& file : files) {
    for (const auto& entry : file.entries()) {
      const auto at = entry.name.find('@');
      Piece piece{.file = &file, .key = entry.name, .offsets = {}};
      if (at != std::string::npos) {
        piece.offsets = parse_numbers(entry.name.substr(at + 1));
      }
      index[entry.name.substr(0, at)].push_back(std::move(piece));
    }
  }
  return index;
}

// Fills `target` (this rank's part of a tensor of `shape`, at `ranges`) from the stored pieces of
// `name`, copying each overlap as stored (bit-identical). Throws unless every element is covered.
void assemble(const PieceIndex& index, const std::string& name, const std::vector<int64_t>& shape,
              const std::vector<ShardRange>& ranges, const at::Tensor& target,
              const std::string& path) {
  const auto found = index.find(name);
  if (found == index.end()) {
    throw std::runtime_error(std::string(kWho) + ": \"" + path + "\" has no \"" + name + "\"");
  }
  int64_t covered = 0;
  for (const auto& piece : found->second) {
    const auto stored = piece.file->view(piece.key);
    const auto offsets =
        piece.offsets.empty() ? std::vector<int64_t>(shape.size(), 0) : piece.offsets;
    if (offsets.size() != shape.size() || stored.dim() != static_cast<int64_t>(shape.size())) {
      throw std::runtime_error(std::string(kWho) + ": \"" + piece.key + "\" in \"" + path +
                               "\" has " + std::to_string(stored.dim()) +
                               " dimensions, the model's \"" + name + "\" has shape " +
                               c10::str(at::IntArrayRef(shape)));
    }
    if (piece.offsets.empty() && stored.sizes() != at::IntArrayRef(shape)) {
      throw std::runtime_error(std::string(kWho) + ": \"" + name + "\" has shape " +
                               c10::str(stored.sizes()) + " in \"" + path + "\", the model has " +
                               c10::str(at::IntArrayRef(shape)));
    }
    at::Tensor from = stored;
    at::Tensor to = target;
    bool overlaps = true;
    for (std::size_t d = 0; d < shape.size() && overlaps; ++d) {
      const int64_t begin = std::max(offsets[d], ranges[d].offset);
      const int64_t end = std::min(offsets[d] + stored.size(static_cast<int64_t>(d)),
                                   ranges[d].offset + ranges[d].length);
      if (end <= begin) {
        overlaps = false;
        break;
      }
      from = from.narrow(static_cast<int64_t>(d), begin - offsets[d], end - begin);
      to = to.narrow(static_cast<int64_t>(d), begin - ranges[d].offset, end - begin);
    }
    if (overlaps) {
      to.copy_(from);
      covered += to.numel();
    }
  }
  if (covered != target.numel()) {
    throw std::runtime_error(std::string(kWho) + ": the pieces of \"" + name + "\" in \"" + path +
                             "\" cover " + std::to_string(covered) + " of the " +
                             std::to_string(target.numel()) +
                             " elements this rank needs (a checkpoint written by another run?)");
  }
}

}  // namespace

struct Checkpointer::Impl {
  explicit Impl(const DeviceMesh& mesh_in) : context(mesh_in.context()), mesh(mesh_in) {}
  DistributedContext context;
  DeviceMesh mesh;
  CheckpointConfig config;
  std::string dir;
  uint64_t seed = 0;
  std::string mesh_description;

  // A save in flight: its step, the temporary directory, and the writer. The writer sets `error`
  // and then `written` (release); the training thread reads `error` only after it has seen
  // `written` true (acquire) or joined the writer, so the two never race.
  int64_t pending_step = -1;
  int64_t pending_samples = 0;
  std::string pending_tmp;
  std::thread writer;
  std::atomic<bool> written{false};
  std::exception_ptr error;
  std::string last;  // the last completed checkpoint

  void join() {
    if (writer.joinable()) {
      writer.join();
    }
  }
  /// Rank 0: makes the pending checkpoint `final_dir` visible (trainer.json, the rename, the
  /// index of kept checkpoints) and drops those past `keep`.
  void commit(const std::string& final_dir) const;
};

void Checkpointer::Impl::commit(const std::string& final_dir) const {
  const nlohmann::json trainer = {{"step", pending_step},
                                  {"samples_seen", pending_samples},
                                  {"world_size", context.world_size()},
                                  {"mesh", mesh_description}};
  // Every rank file is in (each fsynced by its writer); their directory entries and trainer.json
  // reach the disk before the rename that makes the checkpoint visible, and the rename after.
  files::sync_directory(pending_tmp);
  write_atomically(files::join(pending_tmp, "trainer.json"), trainer.dump(2) + "\n");
  files::sync_directory(pending_tmp);
  files::remove_tree(final_dir);
  files::rename(pending_tmp, final_dir);
  files::sync_directory(dir);
  // The index: the new checkpoint first, then the previous ones up to `keep`.
  std::vector<std::string> kept = {step_name(pending_step)};
  std::vector<std::string> dropped;
  const auto index = files::join(dir, "checkpoints.json");
  if (files::exists(index)) {
    const auto old = nlohmann::json::parse(model::read_text_file(index), nullptr, false);
    if (!old.is_discarded() && old.contains("kept") && old["kept"].is_array()) {
      for (const auto& name : old["kept"]) {
        if (name.is_string() && name.get<std::string>() != kept.front()) {
          (static_cast<int64_t>(kept.size()) < config.keep ? kept : dropped)
              .push_back(name.get<std::string>());
        }
      }
    }
  }
  write_atomically(index, nlohmann::json{{"latest", kept.front()}, {"kept", kept}}.dump(2) + "\n");
  files::sync_directory(dir);
  for (const auto& name : dropped) {
    files::remove_tree(files::join(dir, name));
  }
  context.logger().info("checkpoint: " + final_dir + " complete (step " +
                        std::to_string(pending_step) + ", " + std::to_string(kept.size()) +
                        " kept)");
}

Checkpointer::Checkpointer(const DeviceMesh& mesh, CheckpointConfig config, std::string dir,
                           uint64_t seed)
    : impl_(std::make_unique<Impl>(mesh)) {
  auto& s = *impl_;
  s.config = std::move(config);
  s.dir = std::move(dir);
  s.seed = seed;
  s.mesh_description = mesh.shape().describe();
}

Checkpointer::~Checkpointer() { impl_->join(); }

bool Checkpointer::pending() const { return impl_->pending_step >= 0; }
const std::string& Checkpointer::last_completed() const { return impl_->last; }

std::string Checkpointer::latest() const {
  const auto index = files::join(impl_->dir, "checkpoints.json");
  if (!files::exists(index)) {
    return "";
  }
  const auto json = nlohmann::json::parse(model::read_text_file(index), nullptr, false);
  if (json.is_discarded() || !json.contains("latest") || !json["latest"].is_string()) {
    throw std::runtime_error(std::string(kWho) + ": \"" + index +
                             "\" is not a checkpoint index (expected {\"latest\": ...}). Fix: "
                             "remove it, or point \"checkpoint.dir\" elsewhere");
  }
  const auto path = files::join(impl_->dir, json["latest"].get<std::string>());
  if (!files::exists(files::join(path, "trainer.json"))) {
    throw std::runtime_error(std::string(kWho) + ": the index names \"" + path +
                             "\", which has no trainer.json");
  }
  return path;
}

std::string Checkpointer::check(const std::string& path) const {
  if (!files::exists(files::join(path, "trainer.json"))) {
    throw std::runtime_error(std::string(kWho) + ": \"" + path +
                             "\" is not a complete checkpoint (no trainer.json). Fix: point "
                             "\"checkpoint.resume_from\" at a step-<N> directory a run completed");
  }
  return path;
}

namespace {

// What a checkpoint's trainer.json says: its step, the world and mesh it was saved on.
struct SavedRun {
  int64_t step = 0;
  int world = 0;
  std::string mesh = "?";
};

// trainer.json as written by a save: a step >= 0 and a world of at least one rank.
SavedRun read_trainer_json(const std::string& path) {
  const auto trainer_json = files::join(path, "trainer.json");
  SavedRun out;
  try {
    const auto trainer = nlohmann::json::parse(model::read_text_file(trainer_json));
    out.step = trainer.at("step").get<int64_t>();
    const auto world = trainer.at("world_size").get<int64_t>();
    if (out.step < 0 || world < 1 || world > (int64_t{1} << 20)) {
      throw std::out_of_range("step " + std::to_string(out.step) + ", world_size " +
                              std::to_string(world));
    }
    out.world = static_cast<int>(world);
    if (trainer.contains("mesh") && trainer.at("mesh").is_string()) {
      out.mesh = trainer.at("mesh").get<std::string>();
    }
  } catch (const std::exception& error) {
    throw std::runtime_error(std::string(kWho) + ": \"" + trainer_json +
                             "\" is not a checkpoint's trainer.json (" + error.what() +
                             "). Fix: point \"checkpoint.resume_from\" at a checkpoint a run "
                             "completed, or remove this one");
  }
  return out;
}

// One record's part on this rank and its AdamW state (step, moments) from the checkpoint.
void load_record(const PieceIndex& index, const parallel::ParameterRecord& record,
                 const DeviceMesh& mesh, torch::optim::Optimizer& optimizer,
                 const std::string& path, const std::string& saved_mesh) {
  const auto& name = record.name;
  if (index.count("model/" + name) == 0) {
    throw std::runtime_error(std::string(kWho) + ": \"" + path + "\" has no parameter \"" + name +
                             "\" (saved on mesh " + saved_mesh + ")");
  }
  const auto ranges = local_ranges(record, mesh);
  at::Tensor local = record.local;
  assemble(index, "model/" + name, record.global_shape, ranges, local, path);
  const std::string prefix = "optim/" + name + "/";
  const auto step_piece = index.find(prefix + "step");
  if (step_piece == index.end()) {
    optimizer.state().erase(local.unsafeGetTensorImpl());
    return;
  }
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  const auto& piece = step_piece->second.front();
  state->step(piece.file->tensor(piece.key).item<int64_t>());
  auto exp_avg = at::empty_like(local);
  auto exp_avg_sq = at::empty_like(local);
  assemble(index, prefix + "exp_avg", record.global_shape, ranges, exp_avg, path);
  assemble(index, prefix + "exp_avg_sq", record.global_shape, ranges, exp_avg_sq, path);
  state->exp_avg(exp_avg);
  state->exp_avg_sq(exp_avg_sq);
  optimizer.state()[local.unsafeGetTensorImpl()] = std::move(state);
}

}  // namespace

int64_t Checkpointer::load(const std::string& path,
                           const std::vector<parallel::ParameterRecord>& parameters,
                           torch::optim::Optimizer& optimizer, const NamedBuffers& buffers,
                           std::vector<std::string>* missing_buffers) {
  auto& s = *impl_;
  const auto saved = read_trainer_json(path);
  const int64_t step = saved.step;
  const int saved_world = saved.world;
  std::vector<state::SafetensorsFile> files;
  files.reserve(static_cast<std::size_t>(saved_world));
  for (int r = 0; r < saved_world; ++r) {
    files.emplace_back(files::join(path, "rank-" + std::to_string(r) + ".safetensors"));
  }
  const auto index = index_pieces(files);
  const at::NoGradGuard no_grad;
  for (const auto& record : parameters) {
    load_record(index, record, s.mesh, optimizer, path, saved.mesh);
  }
  for (const auto& [name, buffer] : buffers) {
    if (index.count("buffer/" + name) == 0) {
      if (missing_buffers != nullptr) {
        missing_buffers->push_back(name);
      }
      continue;
    }
    assemble(index, "buffer/" + name, buffer.sizes().vec(), whole_ranges(buffer.sizes()), buffer,
             path);
  }
  // Random generators: restored on the same world, reseeded from (seed, rank, step) otherwise.
  const int rank = s.context.rank();
  const auto& own = files[static_cast<std::size_t>(std::min(rank, saved_world - 1))];
  if (saved_world == s.context.world_size() && own.contains("rng/cpu")) {
    auto cpu = at::detail::getDefaultCPUGenerator();
    cpu.set_state(own.tensor("rng/cpu"));
    const auto device = s.context.device();
    if (device.is_cuda() && own.contains("rng/cuda")) {
      auto cuda = at::globalContext().defaultGenerator(device);
      cuda.set_state(own.tensor("rng/cuda"));
    }
  } else {
    at::manual_seed(s.seed + 1 + static_cast<uint64_t>(rank) +
                    1000003ULL * static_cast<uint64_t>(step));
  }
  return step;
}

void Checkpointer::save(int64_t step, int64_t samples_seen,
                        const std::vector<parallel::ParameterRecord>& parameters,
                        const torch::optim::Optimizer& optimizer, const NamedBuffers& buffers) {
  auto& s = *impl_;
  if (pending()) {
    (void)complete(/*wait=*/true);
  }
  const int rank = s.context.rank();
  s.pending_tmp = files::join(s.dir, step_name(step) + ".tmp");
  // The directory exists before anyone writes into it; what interrupted saves of any step left
  // behind goes. Every rank learns of an error here.
  agreed(s.context, kWho, [&] {
    if (rank == 0) {
      for (const auto& name : files::list_directory(s.dir)) {
        if (is_step_tmp(name)) {
          files::remove_tree(files::join(s.dir, name));
        }
      }
      files::create_directories(s.pending_tmp, kWho);
    }
  });

  // The snapshot: host copies of what this rank stores (the training thread may go on after it).
  state::NamedTensors snapshot;
  for (const auto& record : parameters) {
    const auto& param = record.local;
    if (record.tied_copy || !writes(record, s.mesh) || param.numel() == 0) {
      continue;  // its first holder, or another replica writes it, or this rank's shard is empty
    }
    const auto ranges = local_ranges(record, s.mesh);
    const auto key = [&](const std::string& prefix) {
      return piece_key(prefix, ranges, record.global_shape);
    };
    snapshot.emplace_back(key("model/" + record.name), host_copy(param));
    if (const auto* state = adamw_state(optimizer, param)) {
      const std::string prefix = "optim/" + record.name + "/";
      if (ranges.empty() || ranges.front().offset == 0) {
        snapshot.emplace_back(prefix + "step", at::tensor(state->step(), at::kLong));
      }
      snapshot.emplace_back(key(prefix + "exp_avg"), host_copy(state->exp_avg()));
      snapshot.emplace_back(key(prefix + "exp_avg_sq"), host_copy(state->exp_avg_sq()));
    }
  }
  if (writes_buffers(s.mesh)) {
    for (const auto& [name, buffer] : buffers) {
      snapshot.emplace_back("buffer/" + name, host_copy(buffer));
    }
  }
  snapshot.emplace_back("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
  const auto device = s.context.device();
  if (device.is_cuda()) {
    snapshot.emplace_back("rng/cuda", at::globalContext().defaultGenerator(device).get_state());
  }
  s.pending_step = step;
  s.pending_samples = samples_seen;
  s.written = false;
  s.error = nullptr;
  const auto path = files::join(s.pending_tmp, "rank-" + std::to_string(rank) + ".safetensors");
  auto write = [impl = impl_.get(), path, snapshot = std::move(snapshot), step] {
    std::exception_ptr error;
    try {
      state::save_safetensors(path, snapshot, {{"d9d.step", std::to_string(step)}});
    } catch (...) {
      error = std::current_exception();
    }
    impl->error = error;
    impl->written.store(true, std::memory_order_release);
  };
  if (s.config.async) {
    s.writer = std::thread(std::move(write));
  } else {
    write();
    (void)complete(/*wait=*/true);
  }
}

std::string Checkpointer::complete(bool wait) {
  auto& s = *impl_;
  if (!pending()) {
    return "";
  }
  if (wait) {
    s.join();
  }
  // Every rank's writer must be done (and successful) before the checkpoint becomes visible.
  const auto& group = s.context.world();
  const auto flags =
      at::tensor({s.written.load(std::memory_order_acquire) ? 1.0 : 0.0}, at::kDouble);
  const auto total =
      s.context.world_size() > 1 ? all_reduce(group, flags.to(group.device())).cpu() : flags;
  if (total[0].item<double>() < s.context.world_size()) {
    return "";  // someone is still writing: try again at the next step
  }
  s.join();  // done writing: returns at once
  const std::string who =
      std::string(kWho) + " (step " + std::to_string(s.pending_step) + ", " + s.pending_tmp + ")";
  const auto fail = [&] {
    s.pending_step = -1;  // the previous checkpoint stays the latest
    if (s.context.rank() == 0) {
      files::remove_tree(s.pending_tmp);
    }
  };
  try {
    // A writer's failure (any rank's) is thrown on every rank, naming the rank.
    raise_if_any_failed(group, s.error, who);
  } catch (...) {
    fail();
    throw;
  }
  const auto final_dir = files::join(s.dir, step_name(s.pending_step));
  // Rank 0 commits; every rank learns whether that worked (instead of a barrier).
  try {
    agreed(s.context, who, [&] {
      if (s.context.rank() == 0) {
        s.commit(final_dir);
      }
    });
  } catch (...) {
    fail();
    throw;
  }
  s.pending_step = -1;
  s.last = final_dir;
  return final_dir;
}

}  // namespace d9d::detail
