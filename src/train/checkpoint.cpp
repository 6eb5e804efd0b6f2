// d9d/train/checkpoint.cpp — training checkpoints: snapshot, background write, atomic completion.
#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/state/detail/io.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/checkpoint.hpp>
#include <d9d/util/files.hpp>

namespace d9d::detail {
namespace {

constexpr const char* kWho = "d9d checkpoint";

// Writes `text` to `path` through a temporary file and a rename (fsynced).
void write_atomically(const std::string& path, const std::string& text) {
  state::detail::AtomicFile file(path, kWho);
  file.write(text.data(), text.size());
  file.commit();
}

std::string step_name(int64_t step) { return "step-" + std::to_string(step); }

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

}  // namespace

struct Checkpointer::Impl {
  explicit Impl(DistributedContext context_in) : context(std::move(context_in)) {}
  DistributedContext context;
  CheckpointConfig config;
  std::string dir;
  uint64_t seed = 0;
  bool writes_model = false;  // data-parallel coordinate 0: one replica writes the model
  std::string mesh_description;

  // A save in flight: its step, the temporary directory, and the writer.
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
};

Checkpointer::Checkpointer(const DeviceMesh& mesh, CheckpointConfig config, std::string dir,
                           uint64_t seed)
    : impl_(std::make_unique<Impl>(mesh.context())) {
  auto& s = *impl_;
  s.config = std::move(config);
  s.dir = std::move(dir);
  s.seed = seed;
  s.writes_model = mesh.coordinate(MeshDomain::batch, "dp") == 0;
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

int64_t Checkpointer::load(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                           torch::optim::Optimizer& optimizer) {
  auto& s = *impl_;
  const auto trainer =
      nlohmann::json::parse(model::read_text_file(files::join(path, "trainer.json")));
  const auto step = trainer.at("step").get<int64_t>();
  const int saved_world = trainer.at("world_size").get<int>();
  std::vector<state::SafetensorsFile> files;
  files.reserve(static_cast<std::size_t>(saved_world));
  for (int r = 0; r < saved_world; ++r) {
    files.emplace_back(files::join(path, "rank-" + std::to_string(r) + ".safetensors"));
  }
  const auto find = [&](const std::string& name) -> const state::SafetensorsFile* {
    for (const auto& file : files) {
      if (file.contains(name)) {
        return &file;
      }
    }
    return nullptr;
  };
  const at::NoGradGuard no_grad;
  for (const auto& [name, param] : parameters) {
    const auto* file = find("model/" + name);
    if (file == nullptr) {
      throw std::runtime_error(std::string(kWho) + ": \"" + path + "\" has no parameter \"" + name +
                               "\" (saved on mesh " + trainer.value("mesh", std::string("?")) +
                               ")");
    }
    const auto value = file->view("model/" + name);
    if (value.sizes() != param.sizes()) {
      throw std::runtime_error(std::string(kWho) + ": parameter \"" + name + "\" has shape " +
                               c10::str(value.sizes()) + " in \"" + path + "\", the model has " +
                               c10::str(param.sizes()));
    }
    at::Tensor(param).copy_(value);
    const std::string prefix = "optim/" + name + "/";
    if (const auto* state_file = find(prefix + "step")) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(state_file->tensor(prefix + "step").item<int64_t>());
      state->exp_avg(state_file->view(prefix + "exp_avg").to(param.options(), false, true));
      state->exp_avg_sq(state_file->view(prefix + "exp_avg_sq").to(param.options(), false, true));
      optimizer.state()[param.unsafeGetTensorImpl()] = std::move(state);
    } else {
      optimizer.state().erase(param.unsafeGetTensorImpl());
    }
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
                        const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                        const torch::optim::Optimizer& optimizer) {
  auto& s = *impl_;
  if (pending()) {
    (void)complete(/*wait=*/true);
  }
  const int rank = s.context.rank();
  s.pending_tmp = files::join(s.dir, step_name(step) + ".tmp");
  if (rank == 0) {
    files::remove_tree(s.pending_tmp);
    files::create_directories(s.pending_tmp, kWho);
  }
  s.context.barrier();  // the directory exists before anyone writes into it

  // The snapshot: host copies of what this rank stores (the training thread may go on after it).
  state::NamedTensors snapshot;
  if (s.writes_model) {
    for (const auto& [name, param] : parameters) {
      snapshot.emplace_back("model/" + name, host_copy(param));
      if (const auto* state = adamw_state(optimizer, param)) {
        const std::string prefix = "optim/" + name + "/";
        snapshot.emplace_back(prefix + "step", at::tensor(state->step(), at::kLong));
        snapshot.emplace_back(prefix + "exp_avg", host_copy(state->exp_avg()));
        snapshot.emplace_back(prefix + "exp_avg_sq", host_copy(state->exp_avg_sq()));
      }
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
    try {
      state::save_safetensors(path, snapshot, {{"d9d.step", std::to_string(step)}});
    } catch (...) {
      impl->error = std::current_exception();
    }
    impl->written = true;
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
  const auto flags = at::tensor({s.written ? 1.0 : 0.0, s.error ? 1.0 : 0.0}, at::kDouble);
  const auto total =
      s.context.world_size() > 1 ? all_reduce(group, flags.to(group.device())).cpu() : flags;
  if (total[0].item<double>() < s.context.world_size()) {
    return "";  // someone is still writing: try again at the next step
  }
  s.join();
  if (total[1].item<double>() > 0) {
    const auto error = s.error;
    const int64_t step = s.pending_step;
    s.pending_step = -1;  // the previous checkpoint stays the latest
    if (error) {
      std::rethrow_exception(error);
    }
    throw std::runtime_error(std::string(kWho) + ": another rank failed to write step " +
                             std::to_string(step));
  }
  const auto final_dir = files::join(s.dir, step_name(s.pending_step));
  if (s.context.rank() == 0) {
    const nlohmann::json trainer = {{"step", s.pending_step},
                                    {"samples_seen", s.pending_samples},
                                    {"world_size", s.context.world_size()},
                                    {"mesh", s.mesh_description}};
    write_atomically(files::join(s.pending_tmp, "trainer.json"), trainer.dump(2) + "\n");
    files::remove_tree(final_dir);
    files::rename(s.pending_tmp, final_dir);
    state::detail::sync_directory(s.dir);
    // The index: the new checkpoint first, then the previous ones up to `keep`.
    std::vector<std::string> kept = {step_name(s.pending_step)};
    std::vector<std::string> dropped;
    const auto index = files::join(s.dir, "checkpoints.json");
    if (files::exists(index)) {
      const auto old = nlohmann::json::parse(model::read_text_file(index), nullptr, false);
      if (!old.is_discarded() && old.contains("kept") && old["kept"].is_array()) {
        for (const auto& name : old["kept"]) {
          if (name.is_string() && name.get<std::string>() != kept.front()) {
            (static_cast<int64_t>(kept.size()) < s.config.keep ? kept : dropped)
                .push_back(name.get<std::string>());
          }
        }
      }
    }
    write_atomically(index,
                     nlohmann::json{{"latest", kept.front()}, {"kept", kept}}.dump(2) + "\n");
    for (const auto& name : dropped) {
      files::remove_tree(files::join(s.dir, name));
    }
    s.context.logger().info("checkpoint: " + final_dir + " complete (step " +
                            std::to_string(s.pending_step) + ", " + std::to_string(kept.size()) +
                            " kept)");
  }
  s.pending_step = -1;
  s.last = final_dir;
  s.context.barrier();
  return final_dir;
}

}  // namespace d9d::detail
