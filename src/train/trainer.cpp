// d9d/train/trainer.cpp — the training loop: sampling, steps, events, logging, export.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/nn/module.h>

#include <d9d/core/collectives.hpp>
#include <d9d/data/sampler.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/parallel/load.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/track/jsonl.hpp>
#include <d9d/track/progress.hpp>
#include <d9d/track/tensorboard.hpp>
#include <d9d/train/checkpoint.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

namespace d9d::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string format_number(double value, const char* format) {
  std::array<char, 32> buffer{};
  std::snprintf(buffer.data(), buffer.size(), format,
                value);  // NOLINT(cppcoreguidelines-pro-type-vararg)
  return {buffer.data()};
}

// "2 stage(s) per rank, split backward" etc. for the start-up line.
std::string describe(const pipeline::Program& program) {
  return std::to_string(program.stages()) + " stages (" + std::to_string(program.stages_per_rank) +
         " per rank, " + (program.placement == pipeline::Placement::v ? "V" : "loop") +
         " placement" + (program.split_backward ? ", split backward" : "") + ")";
}

// The device allocator's statistics (CUDA and other caching allocators; CPU has none).
c10::DeviceIndex device_index(c10::Device device) {
  return device.has_index() ? device.index()
                            : c10::impl::getDeviceGuardImpl(device.type())->getDevice().index();
}

void reset_peak_memory(c10::Device device) {
  if (!device.is_cpu()) {
    c10::getDeviceAllocator(device.type())->resetPeakStats(device_index(device));
  }
}

int64_t peak_memory(c10::Device device) {
  if (device.is_cpu()) {
    return 0;
  }
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device_index(device));
  return stats.allocated_bytes[0].peak;  // aggregate over pools
}

// When the host launched device work (a kernel, or a whole CUDA graph), sorted.
std::vector<uint64_t> launch_times(
    const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  static const std::set<std::string> names = {
      "cudaLaunchKernel", "cudaLaunchKernelExC",         "cuLaunchKernel",
      "cuLaunchKernelEx", "cudaLaunchCooperativeKernel", "cudaGraphLaunch"};
  std::vector<uint64_t> out;
  for (const auto& event : events) {
    if (event.deviceType() == c10::kCPU && names.contains(event.name())) {
      out.push_back(event.startNs());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Per d9d phase (the RECORD_USER_SCOPE ranges "d9d::step", "d9d::forward", ...): how far the
// memory the profiler saw allocated on `device` rose above its level at the phase's start, at the
// most, over every occurrence of the phase; from the trace's allocation events ("[memory]", bytes
// allocated > 0 or freed < 0; CPU allocations too, so the summary is real on CPU runs). Also the
// phase's host time and the `launches` (launch_times) that start inside it.
nlohmann::json phase_memory(const std::vector<torch::autograd::profiler::KinetoEvent>& events,
                            c10::Device device, const std::vector<uint64_t>& launches) {
  struct Change {
    uint64_t at;
    int64_t bytes;
  };
  std::vector<Change> changes;
  for (const auto& event : events) {
    if (event.name() == "[memory]" && event.deviceType() == device.type()) {
      changes.push_back({event.startNs(), event.nBytes()});
    }
  }
  std::stable_sort(changes.begin(), changes.end(),
                   [](const Change& a, const Change& b) { return a.at < b.at; });
  std::vector<int64_t> live(changes.size() + 1, 0);  // live[i]: before change i
  for (std::size_t i = 0; i < changes.size(); ++i) {
    live[i + 1] = live[i] + changes[i].bytes;
  }
  std::map<std::string, std::pair<int64_t, int64_t>> phases;  // name -> (peak rise, occurrences)
  // Host time and kernel launches (CUDA runtime calls that start inside the phase, any thread).
  std::map<std::string, std::pair<uint64_t, int64_t>> costs;  // name -> (host ns, launches)
  for (const auto& event : events) {
    const auto name = event.name();
    if (name.rfind("d9d::", 0) != 0 || event.deviceType() != c10::kCPU) {
      continue;
    }
    auto& [host_ns, launched] = costs[name];
    host_ns += event.durationNs();
    launched += std::upper_bound(launches.begin(), launches.end(), event.endNs()) -
                std::lower_bound(launches.begin(), launches.end(), event.startNs());
    const auto first =
        std::lower_bound(changes.begin(), changes.end(), event.startNs(),
                         [](const Change& change, uint64_t at) { return change.at < at; });
    const auto begin = static_cast<std::size_t>(first - changes.begin());
    int64_t rise = 0;
    for (std::size_t i = begin; i < changes.size() && changes[i].at <= event.endNs(); ++i) {
      rise = std::max(rise, live[i + 1] - live[begin]);
    }
    auto& [peak, count] = phases[name];
    peak = std::max(peak, rise);
    ++count;
  }
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, value] : phases) {
    const auto& [host_ns, launched] = costs[name];
    out[name] = {{"peak_rise_bytes", value.first},
                 {"occurrences", value.second},
                 {"host_ms", static_cast<double>(host_ns) / 1e6},
                 {"launches", launched}};
  }
  return out;
}

// Device kernels in the trace (CUDA activity that is not a copy, a set or an annotation).
int64_t device_kernels(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  int64_t count = 0;
  for (const auto& event : events) {
    const auto name = event.name();
    if (event.deviceType() == c10::kCUDA && name != "[memory]" && name.rfind("Memcpy", 0) != 0 &&
        name.rfind("Memset", 0) != 0 && name.rfind("d9d::", 0) != 0) {
      ++count;
    }
  }
  return count;
}

// The profiler around the configured steps (Kineto; CUDA kernels when the run is on a GPU).
class StepProfiler {
 public:
  StepProfiler(const ProfileConfig& config, const DistributedContext& context)
      : config_(config), context_(context) {}
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  StepProfiler(StepProfiler&&) = delete;
  StepProfiler& operator=(StepProfiler&&) = delete;
  ~StepProfiler() {
    if (active_) {
      (void)torch::autograd::profiler::disableProfiler();
    }
  }

  void before(int64_t step) {
    if (config_.start < 0 || step != config_.start) {
      return;
    }
    namespace prof = torch::profiler::impl;
    std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
    if (context_.device().is_cuda()) {
      activities.insert(prof::ActivityType::CUDA);
    }
    const prof::ProfilerConfig settings(prof::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                        /*profile_memory=*/true);
    torch::autograd::profiler::prepareProfiler(settings, activities);
    torch::autograd::profiler::enableProfiler(settings, activities);
    reset_peak_memory(context_.device());
    active_ = true;
  }

  // Returns the trace's path on this rank when the profiled steps are over.
  std::string after(int64_t step) {
    if (!active_ || step + 1 < config_.start + config_.steps) {
      return "";
    }
    active_ = false;
    auto result = torch::autograd::profiler::disableProfiler();
    files::create_directories(config_.dir, "d9d profile");
    const auto rank = std::to_string(context_.rank());
    const auto path = files::join(config_.dir, "rank-" + rank + ".trace.json");
    result->save(path);
    const auto launches = launch_times(result->events());
    const nlohmann::json memory = {
        {"rank", context_.rank()},
        {"device", context_.device().str()},
        {"steps", {config_.start, config_.start + config_.steps}},
        // The caching allocator's peak over the traced steps (CUDA; 0 on CPU, which has none).
        {"peak_allocated_bytes", peak_memory(context_.device())},
        // Host launches of device work (kernels, graphs) and device kernels over the traced
        // steps: what CUDA graphs cut (0 on CPU).
        {"launches", launches.size()},
        {"device_kernels", device_kernels(result->events())},
        {"phases", phase_memory(result->events(), context_.device(), launches)}};
    std::FILE* out =
        std::fopen(files::join(config_.dir, "rank-" + rank + ".memory.json").c_str(), "w");
    if (out != nullptr) {
      const auto text = memory.dump(2) + "\n";
      std::fputs(text.c_str(), out);
      std::fclose(out);
    }
    return path;
  }

 private:
  ProfileConfig config_;
  const DistributedContext& context_;
  bool active_ = false;
};

// The buffers of the rank's modules, by their names in the whole model: what training changes
// outside the parameters (every registered buffer; today the MoE routers' selection bias), saved
// and restored with the checkpoints.
NamedBuffers model_buffers(const parallel::ParallelModel& model) {
  NamedBuffers out;
  for (const auto& module : model.modules()) {
    for (const auto& item : module->named_buffers()) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

}  // namespace

struct TrainerCore::Impl {
  Impl(DistributedContext context_in, std::shared_ptr<const DeviceMesh> mesh_in,
       TrainerConfig config_in, ErasedRun run_in)
      : context(std::move(context_in)),
        mesh(std::move(mesh_in)),
        config(std::move(config_in)),
        run(std::move(run_in)) {}
  DistributedContext context;
  std::shared_ptr<const DeviceMesh> mesh;
  TrainerConfig config;
  ErasedRun run;
  EventBus events;
  std::unique_ptr<TrainStepCore> step;
  std::unique_ptr<PipelineStepCore> pipeline_step;  // pipeline plans (instead of step)
  std::unique_ptr<Checkpointer> checkpointer;
  int64_t start_step = 0;  // > 0 when resumed from a checkpoint
  int64_t done_steps = 0;  // optimizer steps in the parameters now
  std::string resumed_from;

  // What this rank trains: the whole model, or its pipeline stages in stage order.
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> modules() const {
    if (pipeline_step) {
      return pipeline_step->stages();
    }
    return {run.model};
  }
  [[nodiscard]] parallel::ParallelModel& parallel() const {
    return pipeline_step ? pipeline_step->parallel() : step->parallel();
  }
  [[nodiscard]] bool sharded() const {
    const auto& records = parallel().parameters();
    return std::any_of(records.begin(), records.end(),
                       [](const auto& record) { return !record.sharded_dims().empty(); });
  }
  torch::optim::Optimizer& optimizer() const {
    return pipeline_step ? pipeline_step->optimizer() : step->optimizer();
  }
  std::optional<data::DistributedSampler> sampler;
  int dp_size = 1;
  int64_t per_rank_batch = 0;
  int64_t microbatches = 0;
};

namespace {

// A parameter's whole value: gathered from its parts when the parallelize layer sharded it, trained
// or frozen (collective: every rank calls it for the same parameters in the same order).
at::Tensor whole_parameter(const TrainerCore::Impl& s, const std::string& name,
                           const at::Tensor& value) {
  const auto* record = s.parallel().layout(name);
  if (record == nullptr) {
    return value;
  }
  return record->sharded_dims().empty() ? record->local : record->sharded(*s.mesh).full_tensor();
}

// The whole model as a Hugging Face checkpoint, streamed one parameter at a time: each is gathered
// from its parts when the parallelize layer sharded it (collective, every rank in the same order)
// and written by the main rank; memory holds one whole parameter beyond the rank's own state.
// With the provider's hf_export_mapper, the model's parameters go through it group by group
// (e.g. stacked experts unstacked into transformers' per-expert tensors): each group's inputs are
// gathered, mapped and written, then dropped.
// With LoRA adapters the checkpoint is the merged model (W + scale B A, no adapter tensors), and
// `adapter_dir` gets the adapters (and the other parameters that train) in Hugging Face peft's
// format; the adapters are gathered first (they are small) and merged as each base weight is
// gathered.
void export_model(TrainerCore::Impl& s, const std::string& dir, const std::string& adapter_dir,
                  at::ScalarType dtype) {
  const auto named = s.run.model->named_parameters();
  const auto adapted = peft::lora_layers(*s.run.model);
  const at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> trained;  // whole values of what trains, under LoRA
  std::map<std::string, const peft::LoraLayer*> adapted_weight;
  std::set<std::string> adapter_parameters;
  for (const auto& layer : adapted) {
    adapted_weight[layer.name + ".weight"] = &layer;
    adapter_parameters.insert(layer.name + ".lora_A.weight");
    adapter_parameters.insert(layer.name + ".lora_B.weight");
  }
  if (!adapted.empty()) {
    for (const auto& item : named) {
      if (s.parallel().find(item.key()) != nullptr) {
        trained[item.key()] = whole_parameter(s, item.key(), item.value());
      }
    }
    if (s.context.is_main_process()) {
      peft::save_adapter(
          *s.run.model, adapter_dir,
          {.dtype = dtype, .whole_tensor = [&](const std::string& name, const at::Tensor& local) {
             const auto it = trained.find(name);
             return it != trained.end() ? it->second : local;
           }});
    }
  }
  const auto global_shape = [&](const std::string& name, const at::Tensor& value) {
    const auto* record = s.parallel().layout(name);
    return record != nullptr ? record->global_shape : value.sizes().vec();
  };
  // The whole value of a parameter, merged with its adapter.
  const auto whole = [&](const std::string& name, const at::Tensor& value) {
    const auto it = trained.find(name);
    at::Tensor out = it != trained.end() ? it->second : whole_parameter(s, name, value);
    if (const auto layer_it = adapted_weight.find(name); layer_it != adapted_weight.end()) {
      const auto& layer = *layer_it->second;
      if (!layer.adapter->merged()) {
        out = peft::merged_weight(out, trained.at(layer.name + ".lora_A.weight"),
                                  trained.at(layer.name + ".lora_B.weight"),
                                  layer.adapter->options());
      }
    }
    return out;
  };
  std::vector<std::string> names;
  for (const auto& item : named) {
    if (adapter_parameters.count(item.key()) == 0) {
      names.push_back(item.key());
    }
  }
  const state::Mapper mapper =
      s.run.hf_export_mapper ? s.run.hf_export_mapper(names) : state::identity(names);
  const auto& groups = mapper.groups();
  const auto inputs_of = [&](const state::MapperGroup& group, bool meta) {
    state::TensorMap inputs;
    for (const auto& key : group.inputs) {
      const auto& value = named[key];
      inputs.emplace(key,
                     meta ? at::empty(global_shape(key, value), value.options().device(at::kMeta))
                          : whole(key, value));
    }
    return inputs;
  };
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& [name, tensor] : mapper.apply(g, inputs_of(groups[g], true))) {
      shapes.emplace_back(name, tensor.sizes().vec());
    }
  }
  std::unique_ptr<model::HfCheckpointWriter> out;
  if (s.context.is_main_process()) {
    out = std::make_unique<model::HfCheckpointWriter>(dir, s.run.hf_config_json, shapes, dtype);
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // Collective when a parameter is sharded: every rank gathers the same groups in order.
    const auto outputs = mapper.apply(g, inputs_of(groups[g], false));
    if (out) {
      for (const auto& [name, tensor] : outputs) {
        out->write(name, tensor);
      }
    }
  }
  if (out) {
    out->commit();
  }
  s.context.barrier();
}

// The whole model from a pipelined run, as export_model writes it: each rank holds only its
// stages, so the stages' owners map their parameters (the provider's hf_export_mapper, per stage)
// and the main rank writes every tensor, streamed one mapper group at a time in key order. A
// group is computed by every rank of its stage's pp coordinate (gathering FullyShard or tensor
// parallel parts is collective over those), then the owner on the main rank's pp group sends its
// outputs (in the export dtype) to pp rank 0. A tensor an earlier stage already wrote (a tied
// embedding's copy on the last stage) is skipped: the checkpoint holds it once.
void export_pipelined(TrainerCore::Impl& s, const std::string& dir, at::ScalarType dtype) {
  const auto& program = s.pipeline_step->program();
  const auto modules = s.pipeline_step->stages();
  const auto pp = s.mesh->group(MeshDomain::regular, "pp");
  const int pp_rank = s.mesh->coordinate(MeshDomain::regular, "pp");
  const auto indices =
      pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank, pp_rank);
  const at::NoGradGuard no_grad;

  // This rank's stages: their mappers and the shapes of every group's outputs.
  struct Part {
    torch::OrderedDict<std::string, at::Tensor> named;
    state::Mapper mapper;
  };
  std::map<int, Part> parts;
  nlohmann::json mine = nlohmann::json::array();
  for (std::size_t i = 0; i < modules.size() && i < indices.size(); ++i) {
    Part part{.named = modules[i]->named_parameters(), .mapper = {}};
    std::vector<std::string> names;
    names.reserve(part.named.size());
    for (const auto& item : part.named) {
      names.push_back(item.key());
    }
    part.mapper = s.run.hf_export_mapper ? s.run.hf_export_mapper(names) : state::identity(names);
    nlohmann::json groups = nlohmann::json::array();
    const auto& mapper_groups = part.mapper.groups();
    for (std::size_t g = 0; g < mapper_groups.size(); ++g) {
      state::TensorMap inputs;
      for (const auto& key : mapper_groups[g].inputs) {
        const auto& value = part.named[key];
        const auto* record = s.parallel().layout(key);
        inputs.emplace(key,
                       at::empty(record != nullptr ? record->global_shape : value.sizes().vec(),
                                 value.options().device(at::kMeta)));
      }
      nlohmann::json outputs = nlohmann::json::array();
      for (const auto& [name, tensor] : part.mapper.apply(g, std::move(inputs))) {
        outputs.push_back({name, tensor.sizes().vec()});
      }
      groups.push_back(std::move(outputs));
    }
    mine.push_back({{"stage", indices[i]}, {"owner", pp_rank}, {"groups", std::move(groups)}});
    parts.emplace(indices[i], std::move(part));
  }
  std::vector<std::string> every = {mine.dump()};
  if (pp.size() > 1) {
    every = all_gather_bytes(pp, every.front());
  }
  // Every stage's groups in stage order (the same list on every rank).
  struct Entry {
    int stage = 0;
    int owner = 0;
    std::size_t group = 0;
    std::vector<std::pair<std::string, std::vector<int64_t>>> outputs;
  };
  std::map<int, std::vector<Entry>> by_stage;
  for (const auto& bytes : every) {
    for (const auto& stage : nlohmann::json::parse(bytes)) {
      const int index = stage.at("stage").get<int>();
      std::size_t g = 0;
      for (const auto& outputs : stage.at("groups")) {
        Entry entry{
            .stage = index, .owner = stage.at("owner").get<int>(), .group = g++, .outputs = {}};
        for (const auto& output : outputs) {
          entry.outputs.emplace_back(output.at(0).get<std::string>(),
                                     output.at(1).get<std::vector<int64_t>>());
        }
        by_stage[index].push_back(std::move(entry));
      }
    }
  }
  std::vector<Entry> entries;
  std::set<std::string> written;
  for (auto& [stage, stage_entries] : by_stage) {
    for (auto& entry : stage_entries) {
      bool fresh = false;
      for (const auto& output : entry.outputs) {
        fresh = written.insert(output.first).second || fresh;
      }
      if (fresh) {  // else every output is a tied copy's, written by an earlier stage
        entries.push_back(std::move(entry));
      }
    }
  }
  // In the order of the export without a pipeline (a mapper's groups come sorted by their keys).
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.outputs.front().first < b.outputs.front().first;
  });
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  written.clear();
  for (const auto& entry : entries) {
    for (const auto& output : entry.outputs) {
      if (written.insert(output.first).second) {
        shapes.push_back(output);
      }
    }
  }

  const bool main = s.context.is_main_process();
  // The pp group of the main rank: its owners send what the main rank writes.
  const bool main_line =
      pp.size() <= 1 || std::find(pp.ranks().begin(), pp.ranks().end(), 0) != pp.ranks().end();
  std::unique_ptr<model::HfCheckpointWriter> out;
  if (main) {
    out = std::make_unique<model::HfCheckpointWriter>(dir, s.run.hf_config_json, shapes, dtype);
  }
  written.clear();
  for (const auto& entry : entries) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(entry.outputs.size());
    if (entry.owner == pp_rank) {
      auto& part = parts.at(entry.stage);
      const auto& group = part.mapper.groups()[entry.group];
      state::TensorMap inputs;
      for (const auto& key : group.inputs) {
        inputs.emplace(key, whole_parameter(s, key, part.named[key]));
      }
      auto outputs = part.mapper.apply(entry.group, std::move(inputs));
      for (const auto& output : entry.outputs) {
        tensors.push_back(outputs.at(output.first).to(dtype).contiguous());
      }
    }
    if (main_line && entry.owner != 0 && (entry.owner == pp_rank || pp_rank == 0)) {
      std::vector<P2POp> ops;
      ops.reserve(entry.outputs.size());
      for (std::size_t i = 0; i < entry.outputs.size(); ++i) {
        if (entry.owner == pp_rank) {
          ops.push_back({.kind = P2POp::Kind::send,
                         .tensor = tensors[i],
                         .peer = 0,
                         .tag = static_cast<int>(i)});
        } else {
          tensors.push_back(at::empty(entry.outputs[i].second,
                                      at::TensorOptions().dtype(dtype).device(pp.device())));
          ops.push_back({.kind = P2POp::Kind::recv,
                         .tensor = tensors.back(),
                         .peer = entry.owner,
                         .tag = static_cast<int>(i)});
        }
      }
      batch_isend_irecv(pp, ops).wait();
    }
    if (out) {
      for (std::size_t i = 0; i < entry.outputs.size(); ++i) {
        if (written.insert(entry.outputs[i].first).second) {
          out->write(entry.outputs[i].first, tensors[i]);
        }
      }
    }
  }
  if (out) {
    out->commit();
  }
  s.context.barrier();
}

// The parameters of the LoRA adapters (lora_A and lora_B, child modules of the layers they adapt),
// by their names under `root`: a base checkpoint does not hold them, and they keep their initial
// values.
std::set<std::string> adapter_parameters(const torch::nn::Module& root) {
  std::set<std::string> out;
  for (const auto& lora : peft::lora_layers(root)) {
    for (const auto& child : lora.layer->named_children()) {
      for (const auto& item : child.value()->named_parameters()) {
        out.insert(lora.name + "." + child.key() + "." + item.key());
      }
    }
  }
  return out;
}

// "logging.pictures": the learning rate of every step of the run and the loss of every step run,
// as SVG line charts next to metrics.jsonl (main rank). Returns the two paths.
std::pair<std::string, std::string> write_pictures(const TrainerConfig& cfg,
                                                   const TrainResult& result) {
  const auto schedule = optim::PiecewiseSchedule::build(cfg.lr_schedule, cfg.run.total_steps);
  track::ChartSeries lr{.label = "", .x = {}, .y = {}};
  for (int64_t step = 0; step < cfg.run.total_steps; ++step) {
    lr.y.push_back(cfg.optimizer.lr * schedule.multiplier(step));
  }
  track::ChartSeries loss{.label = "", .x = {}, .y = result.losses};
  for (std::size_t i = 0; i < result.losses.size(); ++i) {
    loss.x.push_back(static_cast<double>(result.start_step + static_cast<int64_t>(i)));
  }
  const auto lr_path = files::join(cfg.run.output_dir, "lr_schedule.svg");
  const auto loss_path = files::join(cfg.run.output_dir, "loss.svg");
  track::write_text_file(lr_path, track::line_chart({.title = "learning rate",
                                                     .x_label = "step",
                                                     .y_label = "lr",
                                                     .series = {std::move(lr)}}));
  track::write_text_file(loss_path, track::line_chart({.title = "training loss",
                                                       .x_label = "step",
                                                       .y_label = "loss",
                                                       .series = {std::move(loss)}}));
  return {lr_path, loss_path};
}

// "step 8 of 300 (index 7): loss nan, gradient norm 1.234"
std::string describe_step(int64_t step, int64_t total, const StepResult& r) {
  return "step " + std::to_string(step + 1) + " of " + std::to_string(total) + " (index " +
         std::to_string(step) + "): loss " + format_number(r.loss, "%.6g") + ", gradient norm " +
         format_number(r.grad_norm, "%.6g");
}

// Every rank comes here at the same step (the step's finite flag is agreed over the world).
[[noreturn]] void stop_on_nonfinite(TrainerCore::Impl& s, const std::string& what,
                                    int64_t in_a_row) {
  std::string kept;
  if (s.checkpointer) {
    if (s.checkpointer->pending()) {
      (void)s.checkpointer->complete(/*wait=*/true);  // a save of an earlier, finite step
    }
    kept = s.checkpointer->last_completed();
    if (kept.empty()) {
      kept = s.checkpointer->latest();
    }
  }
  const auto& numerics = s.config.numerics;
  const std::string message =
      "d9d::Trainer: a NaN or infinite loss or gradient norm at " + what +
      (in_a_row > 1 ? " (" + std::to_string(in_a_row) +
                          " such steps in a row, more than \"numerics.max_consecutive_skips\" = " +
                          std::to_string(numerics.max_consecutive_skips) + ")"
                    : std::string()) +
      "; training stopped before the optimizer step, the parameters are those of the last finite "
      "step; " +
      (kept.empty() ? std::string("no checkpoint was written")
                    : "the last checkpoint, " + kept + ", is kept") +
      ". Fix: lower \"optimizer.lr\" or \"gradient_clipping.max_norm\", check this step's "
      "data, or set \"numerics.on_nonfinite\": \"skip\" to skip such steps";
  if (s.context.is_main_process()) {
    s.context.logger().error(message);
  }
  throw NumericalError(message);
}

}  // namespace

// d9d/train/detail/build.hpp: what Trainer<Plan> and Inference<Plan> both build.

void require_sequence_length(const TrainerConfig& config) {
  if (config.batch.sequence_length < 1) {
    throw ConfigError(
        "d9d config: \"batch.sequence_length\" is not given, but a pipeline plan sizes the "
        "tensors between stages with it. Fix: set \"batch\": {\"sequence_length\": N, ...}");
  }
}

std::vector<std::shared_ptr<torch::nn::Module>> RankStages::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  out.reserve(stages.size());
  for (const auto& item : stages) {
    out.push_back(item.first);
  }
  return out;
}

void load_init_from(const DistributedContext& context, parallel::ParallelModel& parallel,
                    const std::string& from, const HfLoadMapper& mapper, const std::string& what) {
  state::StreamStats stats;
  try {
    const auto source = state::StateSource::open(from);
    std::vector<std::string> names;
    std::vector<std::string> adapters;
    std::set<std::string> seen;  // a parameter tied across this rank's stages is one name
    for (const auto& module : parallel.modules()) {
      const auto adapted = adapter_parameters(*module);
      for (const auto& item : module->named_parameters()) {
        if (seen.insert(item.key()).second) {
          (adapted.contains(item.key()) ? adapters : names).push_back(item.key());
        }
      }
    }
    stats = parallel::load_state(parallel, source,
                                 {.mapper = mapper ? mapper(source.keys(), names) : state::Mapper(),
                                  .ignore = {},
                                  .allow_unused_inputs = parallel.options().pipelined,
                                  .keep = adapters});
  } catch (const std::exception& error) {
    throw ConfigError("d9d config: \"checkpoint.init_from\" = \"" + from + "\": " + error.what());
  }
  if (context.is_main_process()) {
    context.logger().info(
        what + " from " + from + ": " + std::to_string(stats.outputs) + " tensors, " +
        format_number(static_cast<double>(stats.output_bytes) / 1e6, "%.3g") + " MB on this rank");
  }
}

TrainerCore::TrainerCore(DistributedContext context, std::shared_ptr<const DeviceMesh> mesh,
                         TrainerConfig config, PrecisionOptions precision, ErasedRun run)
    : impl_(std::make_unique<Impl>(std::move(context), std::move(mesh), std::move(config),
                                   std::move(run))) {
  auto& s = *impl_;
  s.dp_size = s.mesh->size(MeshDomain::batch, "dp");
  s.microbatches = s.config.microbatches_per_step(s.dp_size);
  s.per_rank_batch = s.config.batch.global_batch_size / s.dp_size;
  s.sampler.emplace(data::SamplerOptions{.num_samples = s.run.dataset_size,
                                         .dp_rank = s.mesh->coordinate(MeshDomain::batch, "dp"),
                                         .dp_size = s.dp_size,
                                         .seed = s.config.run.seed});
  (void)s.sampler->steps_per_epoch(
      s.per_rank_batch);  // enough data for one step, else a clear error
  TrainStepOptions options{.optimizer = s.config.optimizer,
                           .lr_schedule = s.config.lr_schedule,
                           .total_steps = s.config.run.total_steps,
                           .max_grad_norm = s.config.gradient_clipping.max_norm,
                           .seed = s.config.run.seed,
                           .events = &s.events};
  precision.apply_to(options);
  if (const int64_t n = s.config.logging.pipeline_timeline_step; n > 0) {
    if (!s.run.pipeline) {
      throw ConfigError(
          "d9d config: \"logging.pipeline_timeline_step\" draws a pipeline program's timeline, "
          "but the plan has no pipeline schedule. Fix: remove it, or train with a pipeline plan");
    }
    if (n > s.config.run.total_steps) {
      throw ConfigError(
          "d9d config: \"logging.pipeline_timeline_step\" = " + std::to_string(n) +
          " is past \"run.total_steps\" = " + std::to_string(s.config.run.total_steps) +
          ". Fix: a step from 1 to run.total_steps, or 0 for none");
    }
    options.timeline_step = n - 1;
    options.timeline_path = files::join(s.config.run.output_dir, "pipeline_timeline.svg");
  }
  if (s.run.pipeline && s.config.export_model.enabled) {
    for (const auto& stage : s.run.pipeline->stages) {
      if (peft::has_lora(*stage.first)) {
        throw ConfigError(
            "d9d config: \"export.enabled\" with LoRA adapters under a pipeline plan is not "
            "supported yet (the merged model and the adapter are written from the whole model). "
            "Fix: set \"export\": {\"enabled\": false} and save training checkpoints, or "
            "train the adapters without a pipeline schedule");
      }
    }
  }
  if (s.config.cuda_graphs.enabled && s.run.pipeline) {
    throw ConfigError(
        "d9d config: \"cuda_graphs\" captures the microbatches of a step without a pipeline "
        "schedule; a pipeline program interleaves stages, sends and receives on the host. Fix: "
        "set \"cuda_graphs\": {\"enabled\": false}, or train without a pipeline schedule");
  }
  if (s.run.pipeline) {
    s.pipeline_step = std::make_unique<PipelineStepCore>(
        std::move(s.run.parallel), std::move(*s.run.pipeline), std::move(options));
    s.run.pipeline.reset();
  } else {
    options.after_microbatch = s.run.after_microbatch;
    options.cuda_graphs = s.config.cuda_graphs.enabled;
    options.graph_warmup_steps = s.config.cuda_graphs.warmup_steps;
    options.copier = s.run.copier;
    try {
      s.step = std::make_unique<TrainStepCore>(std::move(s.run.parallel), s.run.loss,
                                               std::move(options));
    } catch (const ConfigError&) {
      throw;
    } catch (const std::invalid_argument& e) {
      if (!s.config.cuda_graphs.enabled) {
        throw;
      }
      std::string why = e.what();
      for (const std::string prefix : {"d9d::TrainStep: ", "d9d: "}) {
        if (why.rfind(prefix, 0) == 0) {
          why.erase(0, prefix.size());
        }
      }
      throw ConfigError("d9d config: \"cuda_graphs\": " + why);
    }
  }

  // Randomness after initialisation differs per rank (dropout and the like).
  torch::manual_seed(s.config.run.seed + 1 + static_cast<uint64_t>(s.context.rank()));

  const auto& checkpoint = s.config.checkpoint;
  if (checkpoint.every > 0 || checkpoint.resume || !checkpoint.resume_from.empty()) {
    s.checkpointer =
        std::make_unique<Checkpointer>(*s.mesh, checkpoint, checkpoint.dir, s.config.run.seed);
  }
  if (!checkpoint.resume_from.empty() || checkpoint.resume) {
    s.resumed_from = checkpoint.resume_from.empty() ? s.checkpointer->latest()
                                                    : s.checkpointer->check(checkpoint.resume_from);
    if (!s.resumed_from.empty()) {
      std::vector<std::string> missing;
      s.start_step = s.checkpointer->load(s.resumed_from, s.parallel().parameters(), s.optimizer(),
                                          model_buffers(s.parallel()), &missing);
      if (!missing.empty() && s.context.is_main_process()) {
        s.context.logger().warning("the checkpoint " + s.resumed_from + " has no \"" +
                                   missing.front() + "\" (and " +
                                   std::to_string(missing.size() - 1) +
                                   " more buffers: saved before checkpoints stored buffers); they "
                                   "keep their initial values");
      }
      if (s.start_step > s.config.run.total_steps) {
        throw ConfigError("d9d config: the checkpoint \"" + s.resumed_from + "\" is at step " +
                          std::to_string(s.start_step) + ", past \"run.total_steps\" = " +
                          std::to_string(s.config.run.total_steps));
      }
      if (s.context.is_main_process()) {
        s.context.logger().info("resuming from " + s.resumed_from + " (step " +
                                std::to_string(s.start_step) + ")");
      }
    }
  }
  if (s.resumed_from.empty() && !checkpoint.init_from.empty()) {
    load_init_from(s.context, s.parallel(), checkpoint.init_from, s.run.hf_load_mapper,
                   "initial weights");
  }
}

TrainerCore::~TrainerCore() = default;

std::string TrainerCore::save_checkpoint() {
  auto& s = *impl_;
  if (!s.checkpointer) {
    throw ConfigError(
        "d9d::Trainer::save_checkpoint: the run has no checkpoints. Fix: give the config a "
        "\"checkpoint\" section (e.g. \"every\": 0 with \"dir\")");
  }
  const int64_t step = std::max(s.done_steps, s.start_step);
  s.checkpointer->save(step, step * s.config.batch.global_batch_size, s.parallel().parameters(),
                       s.optimizer(), model_buffers(s.parallel()));
  if (s.checkpointer->pending()) {
    (void)s.checkpointer->complete(/*wait=*/true);  // async: wait for every rank's writer
  }
  return s.checkpointer->last_completed();
}

EventBus& TrainerCore::events() { return impl_->events; }
const DeviceMesh& TrainerCore::mesh() const { return *impl_->mesh; }
const std::shared_ptr<torch::nn::Module>& TrainerCore::model() const { return impl_->run.model; }
std::vector<std::shared_ptr<torch::nn::Module>> TrainerCore::modules() const {
  return impl_->modules();
}
parallel::ParallelModel& TrainerCore::parallel() { return impl_->parallel(); }
torch::optim::Optimizer& TrainerCore::optimizer() { return impl_->optimizer(); }

StepResult TrainerCore::step(int64_t step) {
  auto& s = *impl_;
  s.events.emit(events::StepStart{.step = step});
  const auto indices = s.sampler->batch(step, s.per_rank_batch);
  const auto batch = s.run.load(indices);
  const auto microbatches = s.run.split(batch, s.microbatches);
  return s.pipeline_step ? s.pipeline_step->run(microbatches, step)
                         : s.step->run(microbatches, step);
}

TrainResult TrainerCore::train() {
  auto& s = *impl_;
  const bool main = s.context.is_main_process();
  const auto& cfg = s.config;
  TrainResult result;
  std::unique_ptr<track::ProgressBar> progress;
  std::unique_ptr<track::JsonlWriter> jsonl;
  std::unique_ptr<track::TensorBoardWriter> tensorboard;
  if (main) {
    files::create_directories(cfg.run.output_dir);
    if (cfg.logging.progress) {
      progress = std::make_unique<track::ProgressBar>(cfg.run.total_steps, "train");
    }
    if (cfg.logging.jsonl) {
      result.metrics_path = files::join(cfg.run.output_dir, "metrics.jsonl");
      jsonl = std::make_unique<track::JsonlWriter>(result.metrics_path);
    }
    if (cfg.logging.tensorboard) {
      result.tensorboard_dir = files::join(cfg.run.output_dir, "tensorboard");
      tensorboard = std::make_unique<track::TensorBoardWriter>(result.tensorboard_dir);
    }
    s.context.logger().info(
        "training " + std::to_string(cfg.run.total_steps) + " steps on " +
        std::to_string(s.context.world_size()) + " rank(s), mesh " + s.mesh->shape().describe() +
        (s.pipeline_step ? ", pipeline of " + describe(s.pipeline_step->program())
                         : std::string()) +
        ", " + std::to_string(s.microbatches) + " microbatch(es) of " +
        std::to_string(cfg.batch.microbatch_size) + " per rank and step");
  }

  // Language models count tokens; a model without "batch.sequence_length" counts samples.
  const int64_t samples_per_step = cfg.batch.global_batch_size;
  const int64_t tokens_per_step = samples_per_step * cfg.batch.sequence_length;
  const bool counts_tokens = tokens_per_step > 0;
  const std::string rate_label = counts_tokens ? "tok/s" : "samples/s";
  const std::string rate_scalar =
      counts_tokens ? "train/tokens_per_second" : "train/samples_per_second";
  const auto per_step = static_cast<double>(counts_tokens ? tokens_per_step : samples_per_step);
  reset_peak_memory(s.context.device());
  const auto start = Clock::now();
  auto after_first = start;
  StepProfiler profiler(cfg.profile, s.context);
  const auto& numerics = cfg.numerics;
  std::deque<double> recent_losses;  // the last numerics.loss_spike_window finite ones
  int64_t skipped_in_a_row = 0;
  for (int64_t step = s.start_step; step < cfg.run.total_steps; ++step) {
    const auto step_start = Clock::now();
    profiler.before(step);
    StepResult r;
    {
      RECORD_USER_SCOPE("d9d::step");
      r = this->step(step);
    }
    if (const auto trace = profiler.after(step); !trace.empty() && main) {
      s.context.logger().info("profile: " + trace + " (steps " + std::to_string(cfg.profile.start) +
                              ".." + std::to_string(step) + ")");
    }
    // The task's metrics: their all-reduce starts now (every rank, at a step that is logged) and
    // is waited for when the step's record is written; the next window starts at once.
    const bool logged = step % cfg.run.log_every == 0 || step + 1 == cfg.run.total_steps;
    if (s.run.metrics && logged) {
      s.run.metrics->sync_start(s.context.world());
    }
    std::optional<events::LossSpike> spike;
    if (!r.finite) {
      ++skipped_in_a_row;
      const auto what = describe_step(step, cfg.run.total_steps, r);
      if (numerics.on_nonfinite == "stop" || skipped_in_a_row > numerics.max_consecutive_skips) {
        stop_on_nonfinite(s, what, skipped_in_a_row);
      }
      if (main) {
        s.context.logger().warning("skipped " + what + ": the optimizer did not step (" +
                                   std::to_string(skipped_in_a_row) + " in a row, at most " +
                                   std::to_string(numerics.max_consecutive_skips) + ")");
      }
      result.skipped_steps.push_back(step);
    } else {
      skipped_in_a_row = 0;
      const auto window = static_cast<std::size_t>(numerics.loss_spike_window);
      if (recent_losses.size() == window) {
        const double mean = std::accumulate(recent_losses.begin(), recent_losses.end(), 0.0) /
                            static_cast<double>(window);
        if (mean > 0 && r.loss > numerics.loss_spike_factor * mean) {
          spike = events::LossSpike{.step = step, .loss = r.loss, .mean = mean};
        }
        recent_losses.pop_front();
      }
      recent_losses.push_back(r.loss);
    }
    s.done_steps = step + 1;
    const double seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    if (step == s.start_step) {
      after_first = Clock::now();
    }
    if (s.checkpointer) {
      const int64_t done = step + 1;
      if (cfg.checkpoint.every > 0 &&
          (done % cfg.checkpoint.every == 0 || done == cfg.run.total_steps)) {
        s.checkpointer->save(done, done * cfg.batch.global_batch_size, s.parallel().parameters(),
                             s.optimizer(), model_buffers(s.parallel()));
      } else if (s.checkpointer->pending()) {
        (void)s.checkpointer->complete(/*wait=*/false);
      }
    }
    result.losses.push_back(r.loss);
    result.grad_norms.push_back(r.grad_norm);
    result.graph_replays += r.replayed_microbatches;
    if (step > s.start_step) {
      result.issue_seconds_per_step += r.issue_seconds;
    }
    s.events.emit(events::StepEnd{.step = step,
                                  .loss = r.loss,
                                  .lr = r.lr,
                                  .grad_norm = r.grad_norm,
                                  .tokens = tokens_per_step,
                                  .samples = samples_per_step,
                                  .seconds = seconds});
    if (spike) {
      result.loss_spikes.push_back(step);
      if (main) {
        s.context.logger().warning("loss spike at " + describe_step(step, cfg.run.total_steps, r) +
                                   ": " + format_number(r.loss / spike->mean, "%.1f") +
                                   "x the mean of the previous " +
                                   std::to_string(numerics.loss_spike_window) + " steps (" +
                                   format_number(spike->mean, "%.6g") + ")");
      }
      s.events.emit(*spike);
    }
    std::vector<std::pair<std::string, double>> metric_scalars;
    if (s.run.metrics && logged) {
      result.metrics.clear();
      for (const auto& [key, value] : s.run.metrics->synced()) {
        metric_scalars.emplace_back("metrics/" + key, value);
        result.metrics["metrics/" + key] = value;
      }
    }
    if (main) {
      const double rate = per_step / seconds;
      if (progress) {
        progress->update(step + 1, {{"loss", format_number(r.loss, "%.4f")},
                                    {"lr", format_number(r.lr, "%.2e")},
                                    {rate_label, track::format_si(rate)}});
      }
      if (logged) {
        std::vector<std::pair<std::string, double>> scalars = {{"train/loss", r.loss},
                                                               {"train/lr", r.lr},
                                                               {"train/grad_norm", r.grad_norm},
                                                               {rate_scalar, rate}};
        for (auto& metric : s.parallel().metrics()) {  // e.g. the MoE routers' balance
          scalars.push_back(std::move(metric));
        }
        for (auto& metric : metric_scalars) {  // the task's metrics
          scalars.push_back(std::move(metric));
        }
        if (jsonl) {
          jsonl->write(step, scalars);
        }
        if (tensorboard) {
          tensorboard->add_scalars(step, scalars);
        }
      }
    }
  }
  if (s.checkpointer) {
    (void)s.checkpointer->complete(/*wait=*/true);
    result.checkpoint_dir = s.checkpointer->last_completed();
  }
  const auto end = Clock::now();
  result.start_step = s.start_step;
  result.resumed_from = s.resumed_from;
  result.steps = cfg.run.total_steps - s.start_step;
  result.seconds = std::chrono::duration<double>(end - start).count();
  const double timed = std::chrono::duration<double>(end - after_first).count();
  if (result.steps > 1) {
    result.issue_seconds_per_step /= static_cast<double>(result.steps - 1);
  } else {
    result.issue_seconds_per_step = 0.0;
  }
  if (result.steps > 1 && timed > 0) {
    result.tokens_per_second = static_cast<double>(tokens_per_step * (result.steps - 1)) / timed;
    result.samples_per_second = static_cast<double>(samples_per_step * (result.steps - 1)) / timed;
  }
  result.peak_memory_bytes = peak_memory(s.context.device());
  if (s.context.world_size() > 1) {
    const auto& world = s.context.world();
    const auto peak = at::tensor({static_cast<double>(result.peak_memory_bytes)}, at::kDouble);
    result.peak_memory_bytes = static_cast<int64_t>(
        all_reduce(world, peak.to(world.device()), ReduceOp::max).cpu().item<double>());
  }
  s.events.emit(events::TrainEnd{.steps = result.steps, .seconds = result.seconds});
  if (progress) {
    progress->finish();
  }
  if (tensorboard) {
    tensorboard->flush();
  }
  if (main && cfg.logging.pictures) {
    std::tie(result.lr_schedule_svg, result.loss_svg) = write_pictures(cfg, result);
  }

  if (cfg.export_model.enabled && s.pipeline_step) {
    if (main) {
      result.export_dir = files::join(cfg.run.output_dir, "model");
    }
    export_pipelined(s, files::join(cfg.run.output_dir, "model"),
                     cfg.export_model.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat);
  } else if (cfg.export_model.enabled) {
    if (main) {
      result.export_dir = files::join(cfg.run.output_dir, "model");
    }
    if (main && peft::has_lora(*s.run.model)) {
      result.adapter_dir = files::join(cfg.run.output_dir, "adapter");
    }
    export_model(s, files::join(cfg.run.output_dir, "model"),
                 files::join(cfg.run.output_dir, "adapter"),
                 cfg.export_model.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat);
  }
  if (main && !result.losses.empty()) {
    s.context.logger().info("done: " + std::to_string(result.steps) + " steps in " +
                            format_number(result.seconds, "%.1f") + " s, loss " +
                            format_number(result.losses.front(), "%.4f") + " -> " +
                            format_number(result.losses.back(), "%.4f"));
    if (!result.metrics_path.empty()) {
      s.context.logger().info("metrics: " + result.metrics_path);
    }
    if (!result.tensorboard_dir.empty()) {
      s.context.logger().info("tensorboard: " + result.tensorboard_dir);
    }
    if (!result.loss_svg.empty()) {
      s.context.logger().info("pictures: " + result.lr_schedule_svg + ", " + result.loss_svg);
    }
    if (!result.export_dir.empty()) {
      s.context.logger().info("model: " + result.export_dir +
                              (s.run.hf_config_json.empty() ? " (model.safetensors)"
                                                            : " (model.safetensors, config.json)"));
    }
    if (!result.adapter_dir.empty()) {
      s.context.logger().info("adapter: " + result.adapter_dir +
                              " (adapter_model.safetensors, adapter_config.json)");
    }
    if (!result.checkpoint_dir.empty()) {
      s.context.logger().info("checkpoint: " + result.checkpoint_dir);
    }
  }
  return result;
}

}  // namespace d9d::detail
