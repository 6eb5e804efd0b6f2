// d9d/train/export.cpp — the model exports of the two steps (d9d/train/detail/export.hpp).
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/train/detail/export.hpp>

namespace d9d::detail {
namespace {

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A parameter's whole value: gathered from its parts when the parallelize layer sharded it, trained
// or frozen (collective: every rank calls it for the same parameters in the same order).
at::Tensor whole_parameter(const parallel::ParallelModel& parallel, const std::string& name,
                           const at::Tensor& value) {
  const auto* record = parallel.layout(name);
  if (record == nullptr) {
    return value;
  }
  return record->sharded_dims().empty() ? record->local
                                        : record->sharded(parallel.mesh()).full_tensor();
}

// The whole parameter's shape (the record's global shape when a strategy split it).
std::vector<int64_t> global_shape(const parallel::ParallelModel& parallel, const std::string& name,
                                  const at::Tensor& value) {
  const auto* record = parallel.layout(name);
  return record != nullptr ? record->global_shape : value.sizes().vec();
}

state::Mapper mapper_for(const ExportRequest& request, const std::vector<std::string>& names) {
  return request.mapper ? request.mapper(names) : state::identity(names);
}

// The names and shapes of the outputs of `mapper`'s group `g`, from meta tensors of the inputs'
// global shapes.
Shapes group_shapes(const parallel::ParallelModel& parallel, const state::Mapper& mapper,
                    std::size_t g, const torch::OrderedDict<std::string, at::Tensor>& named) {
  state::TensorMap inputs;
  for (const auto& key : mapper.groups()[g].inputs) {
    const auto& value = named[key];
    inputs.emplace(
        key, at::empty(global_shape(parallel, key, value), value.options().device(at::kMeta)));
  }
  Shapes out;
  for (const auto& [name, tensor] : mapper.apply(g, std::move(inputs))) {
    out.emplace_back(name, tensor.sizes().vec());
  }
  return out;
}

// The names and shapes of every output of `mapper`, group by group.
Shapes output_shapes(const parallel::ParallelModel& parallel, const state::Mapper& mapper,
                     const torch::OrderedDict<std::string, at::Tensor>& named) {
  Shapes out;
  for (std::size_t g = 0; g < mapper.groups().size(); ++g) {
    auto shapes = group_shapes(parallel, mapper, g, named);
    out.insert(out.end(), shapes.begin(), shapes.end());
  }
  return out;
}

// ---- the whole model ----------------------------------------------------------------------------

// The model's LoRA adapters: the whole values of what trains (gathered: they are small), the
// adapted weights by name, and the adapters' own parameter names; the adapter written in peft's
// format by the main rank.
struct Adapters {
  std::map<std::string, at::Tensor> trained;
  std::map<std::string, const peft::LoraLayer*> adapted_weight;
  std::set<std::string> parameters;
};

Adapters export_adapters(const parallel::ParallelModel& parallel, const torch::nn::Module& model,
                         const std::vector<peft::LoraLayer>& layers, const ExportRequest& request) {
  Adapters out;
  for (const auto& layer : layers) {
    out.adapted_weight[layer.weight_name()] = &layer;
    out.parameters.insert(layer.a_name());
    out.parameters.insert(layer.b_name());
  }
  if (layers.empty()) {
    return out;
  }
  for (const auto& item : model.named_parameters()) {
    if (parallel.find(item.key()) != nullptr) {
      out.trained[item.key()] = whole_parameter(parallel, item.key(), item.value());
    }
  }
  if (parallel.mesh().context().is_main_process()) {
    peft::save_adapter(model, request.adapter_dir,
                       {.dtype = request.dtype,
                        .whole_tensor = [&](const std::string& name, const at::Tensor& local) {
                          const auto it = out.trained.find(name);
                          return it != out.trained.end() ? it->second : local;
                        }});
  }
  return out;
}

}  // namespace

ExportResult export_whole_model(const parallel::ParallelModel& parallel,
                                const torch::nn::Module& model, const ExportRequest& request) {
  const at::NoGradGuard no_grad;
  const auto& context = parallel.mesh().context();
  const auto named = model.named_parameters();
  const auto layers = peft::lora_layers(model);
  const auto adapters = export_adapters(parallel, model, layers, request);
  // The whole value of a parameter, merged with its adapter.
  const auto whole = [&](const std::string& name, const at::Tensor& value) {
    const auto it = adapters.trained.find(name);
    at::Tensor out =
        it != adapters.trained.end() ? it->second : whole_parameter(parallel, name, value);
    if (const auto layer_it = adapters.adapted_weight.find(name);
        layer_it != adapters.adapted_weight.end() && !layer_it->second->merged()) {
      const auto& layer = *layer_it->second;
      out = peft::merged_weight(out, adapters.trained.at(layer.a_name()),
                                adapters.trained.at(layer.b_name()), layer.options());
    }
    return out;
  };
  std::vector<std::string> names;
  for (const auto& item : named) {
    if (adapters.parameters.count(item.key()) == 0) {
      names.push_back(item.key());
    }
  }
  const state::Mapper mapper = mapper_for(request, names);
  std::unique_ptr<model::HfCheckpointWriter> out;
  if (context.is_main_process()) {
    out = std::make_unique<model::HfCheckpointWriter>(
        request.dir, request.hf_config_json, output_shapes(parallel, mapper, named), request.dtype);
  }
  const auto& groups = mapper.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // Collective when a parameter is sharded: every rank gathers the same groups in order.
    state::TensorMap inputs;
    for (const auto& key : groups[g].inputs) {
      inputs.emplace(key, whole(key, named[key]));
    }
    for (const auto& [name, tensor] : mapper.apply(g, std::move(inputs))) {
      if (out) {
        out->write(name, tensor);
      }
    }
  }
  if (out) {
    out->commit();
  }
  context.barrier();
  ExportResult result;
  if (context.is_main_process()) {
    result.model_dir = request.dir;
    result.adapter_dir = layers.empty() ? std::string() : request.adapter_dir;
  }
  return result;
}

// ---- a pipeline's stages ------------------------------------------------------------------------

namespace {

// One of this rank's stages: its parameters, their mapper (without the adapters' own) and its
// adapted layers by weight name.
struct StagePart {
  torch::OrderedDict<std::string, at::Tensor> named;
  state::Mapper mapper;
  std::map<std::string, peft::LoraLayer> adapted;
};

// One mapper group of one stage, as every rank of the pp group knows it.
struct Entry {
  int stage = 0;
  int owner = 0;  ///< the pp rank holding the stage
  std::size_t group = 0;
  Shapes outputs;
};

// This rank's stages' parts, and their groups' output shapes as JSON for the other pp ranks.
std::map<int, StagePart> stage_parts(const parallel::ParallelModel& parallel,
                                     const std::vector<std::shared_ptr<torch::nn::Module>>& stages,
                                     const std::vector<int>& indices, int pp_rank,
                                     const ExportRequest& request, nlohmann::json& mine) {
  std::map<int, StagePart> parts;
  mine = nlohmann::json::array();
  for (std::size_t i = 0; i < stages.size() && i < indices.size(); ++i) {
    StagePart part{.named = stages[i]->named_parameters(), .mapper = {}, .adapted = {}};
    std::set<std::string> adapter_parameters;
    for (const auto& layer : peft::lora_layers(*stages[i])) {
      part.adapted.emplace(layer.weight_name(), layer);
      adapter_parameters.insert(layer.a_name());
      adapter_parameters.insert(layer.b_name());
    }
    std::vector<std::string> names;
    names.reserve(part.named.size());
    for (const auto& item : part.named) {
      if (adapter_parameters.count(item.key()) == 0) {
        names.push_back(item.key());
      }
    }
    part.mapper = mapper_for(request, names);
    nlohmann::json groups = nlohmann::json::array();
    for (std::size_t g = 0; g < part.mapper.groups().size(); ++g) {
      nlohmann::json outputs = nlohmann::json::array();
      for (const auto& [name, shape] : group_shapes(parallel, part.mapper, g, part.named)) {
        outputs.push_back({name, shape});
      }
      groups.push_back(std::move(outputs));
    }
    mine.push_back({{"stage", indices[i]}, {"owner", pp_rank}, {"groups", std::move(groups)}});
    parts.emplace(indices[i], std::move(part));
  }
  return parts;
}

// Every stage's groups (all-gathered over pp), each written once: a group whose every output an
// earlier stage already has (a tied copy) is left out; sorted as the export without a pipeline
// (a mapper's groups come sorted by their keys).
std::vector<Entry> every_entry(const ProcessGroup& pp, const nlohmann::json& mine) {
  std::vector<std::string> every = {mine.dump()};
  if (pp.size() > 1) {
    every = all_gather_bytes(pp, every.front());
  }
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
      if (fresh) {
        entries.push_back(std::move(entry));
      }
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.outputs.front().first < b.outputs.front().first;
  });
  return entries;
}

// The checkpoint's tensors in order, each once.
Shapes unique_shapes(const std::vector<Entry>& entries) {
  Shapes shapes;
  std::set<std::string> written;
  for (const auto& entry : entries) {
    for (const auto& output : entry.outputs) {
      if (written.insert(output.first).second) {
        shapes.push_back(output);
      }
    }
  }
  return shapes;
}

// Brings `tensors` (computed on pp rank `owner`, one per shape) to pp rank 0 on the main rank's
// pp group: the owner sends them, pp rank 0 appends what it receives. Other ranks, and every rank
// of the other pp groups, do nothing.
void to_first_rank(const ProcessGroup& pp, int pp_rank, bool main_line, int owner,
                   const Shapes& shapes, at::ScalarType dtype, std::vector<at::Tensor>& tensors) {
  if (!main_line || owner == 0 || (owner != pp_rank && pp_rank != 0)) {
    return;
  }
  std::vector<P2POp> ops;
  ops.reserve(shapes.size());
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    if (owner == pp_rank) {
      ops.push_back(
          {.kind = P2POp::Kind::send, .tensor = tensors[i], .peer = 0, .tag = static_cast<int>(i)});
    } else {
      tensors.push_back(
          at::empty(shapes[i].second, at::TensorOptions().dtype(dtype).device(pp.device())));
      ops.push_back({.kind = P2POp::Kind::recv,
                     .tensor = tensors.back(),
                     .peer = owner,
                     .tag = static_cast<int>(i)});
    }
  }
  batch_isend_irecv(pp, ops).wait();
}

// One entry's tensors on this rank: computed by every rank of the owner's pp coordinate
// (gathering sharded parts is collective over those), then sent by the owner on the main rank's
// pp group to pp rank 0 (in the export dtype). Empty on ranks that neither own nor receive it.
std::vector<at::Tensor> entry_tensors(const parallel::ParallelModel& parallel,
                                      std::map<int, StagePart>& parts, const Entry& entry,
                                      const ProcessGroup& pp, int pp_rank, bool main_line,
                                      at::ScalarType dtype) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(entry.outputs.size());
  if (entry.owner == pp_rank) {
    auto& part = parts.at(entry.stage);
    state::TensorMap inputs;
    for (const auto& key : part.mapper.groups()[entry.group].inputs) {
      auto value = whole_parameter(parallel, key, part.named[key]);
      // An adapted weight goes out with its adapter merged in (collective like the weight's
      // gather: every rank of the owner's pp coordinate runs the same entries in order).
      if (const auto it = part.adapted.find(key);
          it != part.adapted.end() && !it->second.merged()) {
        const auto& layer = it->second;
        const auto a = layer.a_name();
        const auto b = layer.b_name();
        value = peft::merged_weight(value, whole_parameter(parallel, a, part.named[a]),
                                    whole_parameter(parallel, b, part.named[b]), layer.options());
      }
      inputs.emplace(key, std::move(value));
    }
    auto outputs = part.mapper.apply(entry.group, std::move(inputs));
    for (const auto& output : entry.outputs) {
      tensors.push_back(outputs.at(output.first).to(dtype).contiguous());
    }
  }
  to_first_rank(pp, pp_rank, main_line, entry.owner, entry.outputs, dtype, tensors);
  return tensors;
}

// Every pipeline stage's adapters as one peft adapter, written by the main rank: each stage
// describes its part (AdapterContents and the shapes of its parameters), the parts merge in
// stage order, and each file tensor's owner gathers it whole and sends it to pp rank 0 (the main
// rank's pp group only). False when no stage has an adapter.
bool export_stage_adapters(const parallel::ParallelModel& parallel, std::map<int, StagePart>& parts,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& stages,
                           const std::vector<int>& indices, const ProcessGroup& pp, int pp_rank,
                           bool main_line, const ExportRequest& request) {
  nlohmann::json mine = nlohmann::json::array();
  for (std::size_t i = 0; i < stages.size() && i < indices.size(); ++i) {
    nlohmann::json shapes = nlohmann::json::object();
    for (const auto& item : stages[i]->named_parameters()) {
      shapes[item.key()] = global_shape(parallel, item.key(), item.value());
    }
    mine.push_back({{"stage", indices[i]},
                    {"owner", pp_rank},
                    {"contents", peft::adapter_contents(*stages[i]).to_json()},
                    {"shapes", std::move(shapes)}});
  }
  std::vector<std::string> every = {mine.dump()};
  if (pp.size() > 1) {
    every = all_gather_bytes(pp, every.front());
  }
  std::map<int, nlohmann::json> by_stage;
  for (const auto& bytes : every) {
    for (auto& stage : nlohmann::json::parse(bytes)) {
      const int index = stage.at("stage").get<int>();  // before the move (json's = takes a value)
      by_stage[index] = std::move(stage);
    }
  }
  peft::AdapterContents contents;
  for (const auto& [index, stage] : by_stage) {
    contents.merge(peft::AdapterContents::from_json(stage.at("contents").get<std::string>()));
  }
  if (contents.layers.empty()) {
    return false;
  }
  std::map<std::string, at::Tensor> file;
  for (const auto& name : contents.tensor_names()) {
    // The first stage holding the tensor owns it (a tied copy on a later stage is the same).
    const auto holder = std::find_if(by_stage.begin(), by_stage.end(), [&](const auto& item) {
      return item.second.at("shapes").contains(name);
    });
    const int stage = holder->first;
    const int owner = holder->second.at("owner").get<int>();
    const Shapes shape = {{name, holder->second.at("shapes").at(name).get<std::vector<int64_t>>()}};
    std::vector<at::Tensor> tensors;
    if (owner == pp_rank) {
      auto& part = parts.at(stage);
      tensors.push_back(
          whole_parameter(parallel, name, part.named[name]).to(request.dtype).contiguous());
    }
    to_first_rank(pp, pp_rank, main_line, owner, shape, request.dtype, tensors);
    if (!tensors.empty()) {
      file[name] = tensors.front();
    }
  }
  if (parallel.mesh().context().is_main_process()) {
    peft::save_adapter(contents, request.adapter_dir,
                       [&](const std::string& name) { return file.at(name); },
                       {.dtype = request.dtype});
  }
  return true;
}

}  // namespace

ExportResult export_stages(const parallel::ParallelModel& parallel,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& stages,
                           const pipeline::Program& program, const ExportRequest& request) {
  const at::NoGradGuard no_grad;
  const auto& mesh = parallel.mesh();
  const auto pp = mesh.group(MeshDomain::regular, "pp");
  const int pp_rank = mesh.coordinate(MeshDomain::regular, "pp");
  const auto indices =
      pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank, pp_rank);
  nlohmann::json mine;
  auto parts = stage_parts(parallel, stages, indices, pp_rank, request, mine);
  const auto entries = every_entry(pp, mine);
  const bool main = mesh.context().is_main_process();
  // The pp group of the main rank: its owners send what the main rank writes.
  const bool main_line =
      pp.size() <= 1 || std::find(pp.ranks().begin(), pp.ranks().end(), 0) != pp.ranks().end();
  std::unique_ptr<model::HfCheckpointWriter> out;
  if (main) {
    out = std::make_unique<model::HfCheckpointWriter>(request.dir, request.hf_config_json,
                                                      unique_shapes(entries), request.dtype);
  }
  std::set<std::string> written;
  for (const auto& entry : entries) {
    const auto tensors =
        entry_tensors(parallel, parts, entry, pp, pp_rank, main_line, request.dtype);
    for (std::size_t i = 0; out && i < entry.outputs.size(); ++i) {
      if (written.insert(entry.outputs[i].first).second) {
        out->write(entry.outputs[i].first, tensors[i]);
      }
    }
  }
  if (out) {
    out->commit();
  }
  const bool adapters =
      export_stage_adapters(parallel, parts, stages, indices, pp, pp_rank, main_line, request);
  mesh.context().barrier();
  ExportResult result;
  if (main) {
    result.model_dir = request.dir;
    result.adapter_dir = adapters ? request.adapter_dir : std::string();
  }
  return result;
}

}  // namespace d9d::detail
