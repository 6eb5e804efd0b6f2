// d9d/model/hf_moe.cpp — Qwen3-MoE checkpoints of transformers: per-expert tensors <-> stacked
// experts through state mappers, streamed both ways.
#include <algorithm>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/model/hf.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/state/stream.hpp>
#include <d9d/util/files.hpp>

namespace d9d::model {
namespace {

// "<prefix>.mlp.experts.<projection>": a stacked expert tensor of d9d's Qwen3-MoE.
struct Stacked {
  std::string prefix;      // "model.layers.3.mlp.experts"
  std::string projection;  // "gate_proj", "up_proj" or "down_proj"
};

std::optional<Stacked> stacked(const std::string& name) {
  static const std::regex pattern(R"(^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$)");
  std::smatch match;
  if (!std::regex_match(name, match, pattern)) {
    return std::nullopt;
  }
  return Stacked{.prefix = match[1].str(), .projection = match[2].str()};
}

std::vector<std::string> per_expert(const Stacked& s, int64_t experts) {
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) {
    keys.push_back(s.prefix + "." + std::to_string(e) + "." + s.projection + ".weight");
  }
  return keys;
}

std::vector<std::string> parameter_names(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) {
    names.push_back(item.key());
  }
  return names;
}

}  // namespace

state::Mapper qwen3_moe_hf_load_mapper(const Qwen3MoeConfig& config,
                                       const std::vector<std::string>& source_keys,
                                       const std::vector<std::string>& parameter_names) {
  const std::set<std::string> source(source_keys.begin(), source_keys.end());
  const std::set<std::string> params(parameter_names.begin(), parameter_names.end());
  std::vector<state::Mapper> parts;
  std::vector<std::string> plain;
  std::set<std::string> fused_done;
  for (const auto& name : parameter_names) {
    const auto s = stacked(name);
    if (!s) {
      plain.push_back(name);
      continue;
    }
    const auto keys = per_expert(*s, config.num_experts);
    const std::string fused = s->prefix + ".gate_up_proj";
    if (source.contains(keys.front()) || !(source.contains(fused) || source.contains(name))) {
      parts.push_back(state::stack(keys, name, 0));  // the checkpoint layout of transformers
    } else if (s->projection == "down_proj") {
      plain.push_back(name);  // transformers 5's in-memory layout: the same name and shape
    } else if (fused_done.insert(fused).second) {
      parts.push_back(
          state::chunk(fused, {s->prefix + ".gate_proj", s->prefix + ".up_proj"}, /*dim=*/1));
    }
  }
  parts.push_back(state::identity(plain));
  if (config.tie_word_embeddings && source.contains("lm_head.weight") &&
      !params.contains("lm_head.weight")) {
    parts.push_back(state::drop({"lm_head.weight"}));  // some tied checkpoints store it anyway
  }
  return state::parallel(parts);
}

state::Mapper qwen3_moe_hf_export_mapper(const Qwen3MoeConfig& config,
                                         const std::vector<std::string>& parameter_names) {
  std::vector<state::Mapper> parts;
  std::vector<std::string> plain;
  for (const auto& name : parameter_names) {
    if (const auto s = stacked(name)) {
      parts.push_back(state::unstack(name, per_expert(*s, config.num_experts), 0));
    } else {
      plain.push_back(name);
    }
  }
  parts.push_back(state::identity(plain));
  return state::parallel(parts);
}

void load_hf_qwen3_moe_into(torch::nn::Module& model, const Qwen3MoeConfig& config,
                            const std::string& dir) {
  const auto source = state::StateSource::open(dir);
  const auto mapper = qwen3_moe_hf_load_mapper(config, source.keys(), parameter_names(model));
  // Only the auxiliary-loss-free bias (a buffer transformers does not have) may stay unloaded.
  const auto outputs = mapper.outputs();
  bool only_bias_missing = true;
  for (const auto& item : model.named_buffers()) {
    const bool bias = item.key().size() >= 11 &&
                      item.key().compare(item.key().size() - 11, 11, "expert_bias") == 0;
    if (!bias && !std::binary_search(outputs.begin(), outputs.end(), item.key())) {
      only_bias_missing = false;
    }
  }
  for (const auto& item : model.named_parameters()) {
    if (!std::binary_search(outputs.begin(), outputs.end(), item.key())) {
      only_bias_missing = false;
    }
  }
  (void)state::load_into(model, source, mapper, {.allow_missing = only_bias_missing});
}

Qwen3MoeForCausalLM load_hf_qwen3_moe(const std::string& dir) {
  const auto config =
      Qwen3MoeConfig::from_json_text(read_text_file(files::join(dir, "config.json")));
  Qwen3MoeForCausalLM model(config);
  load_hf_qwen3_moe_into(*model, config, dir);
  return model;
}

void save_hf_mapped(const torch::nn::Module& module, const state::Mapper& mapper,
                    const std::string& dir, const std::string& config_json, at::ScalarType dtype) {
  const auto params = module.named_parameters();
  const auto inputs_of = [&](const state::MapperGroup& group, bool meta) {
    state::TensorMap inputs;
    for (const auto& key : group.inputs) {
      const auto* found = params.find(key);
      if (found == nullptr) {
        throw std::invalid_argument("d9d::model::save_hf_mapped: the mapper reads \"" + key +
                                    "\", which the module does not have");
      }
      inputs.emplace(key, meta ? at::empty(found->sizes(), found->options().device(at::kMeta))
                               : found->detach());
    }
    return inputs;
  };
  // The file's header from the groups applied to meta tensors (no data), then group by group.
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  const auto& groups = mapper.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& [name, tensor] : mapper.apply(g, inputs_of(groups[g], true))) {
      shapes.emplace_back(name, tensor.sizes().vec());
    }
  }
  HfCheckpointWriter out(dir, config_json, shapes, dtype);
  const at::NoGradGuard no_grad;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& [name, tensor] : mapper.apply(g, inputs_of(groups[g], false))) {
      out.write(name, tensor);
    }
  }
  out.commit();
}

void save_hf_qwen3_moe(const Qwen3MoeForCausalLMImpl& model, const std::string& dir,
                       at::ScalarType dtype) {
  save_hf_mapped(model, qwen3_moe_hf_export_mapper(model.config(), parameter_names(model)), dir,
                 model.config().to_hf_json(dtype == at::kBFloat16 ? "bfloat16" : "float32"), dtype);
}

}  // namespace d9d::model
