// d9d/peft/adapter_io.cpp — adapters in Hugging Face peft's file format, both ways, and the merged
// model as a Hugging Face checkpoint.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/model/hf.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::peft {
namespace {

using Json = nlohmann::json;

constexpr const char* kPrefix = "base_model.model.";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
constexpr const char* kConfigFile = "adapter_config.json";

void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  if (out == nullptr) {
    throw std::runtime_error("d9d::peft: cannot write " + tmp + ": " + std::strerror(errno));
  }
  const bool ok = std::fputs(text.c_str(), out) >= 0;
  if (std::fclose(out) != 0 || !ok) {
    throw std::runtime_error("d9d::peft: cannot write " + tmp);
  }
  files::rename(tmp, path);
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

std::string owner_of(const std::string& parameter) {
  const auto dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}

std::string regex_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (std::strchr(".^$|()[]{}*+?\\", c) != nullptr) {
      out += '\\';
    }
    out += c;
  }
  return out;
}

// Every submodule by name, without the adapters' own layers.
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> module_names(
    const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto last = last_component(item.key());
    if (last != "lora_A" && last != "lora_B") {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

std::set<std::string> adapter_parameter_names(const std::vector<LoraLayer>& layers) {
  std::set<std::string> out;
  for (const auto& layer : layers) {
    out.insert(layer.a_name());
    out.insert(layer.b_name());
  }
  return out;
}

// A's and B's names in the model for a layer of the contents (as LoraLayer::a_name / b_name).
std::array<std::string, 2> factor_names(const AdapterContents::Layer& layer) {
  if (layer.experts > 0) {
    return {layer.name + "_lora_A", layer.name + "_lora_B"};
  }
  return {layer.name + ".lora_A.weight", layer.name + ".lora_B.weight"};
}

// An expert projection's per-expert module in peft's (transformers 4's) layout:
// "<experts>.<e>.<projection>".
std::string expert_module(const std::string& projection_name, int64_t expert) {
  const auto dot = projection_name.rfind('.');
  return projection_name.substr(0, dot) + "." + std::to_string(expert) +
         projection_name.substr(dot);
}

Json number(double value) {
  if (std::floor(value) == value && std::abs(value) < 1e15) {
    return static_cast<int64_t>(value);
  }
  return value;
}

at::Tensor whole(const at::Tensor& tensor, const std::string& name, const char* who) {
  if (tensor.storage().nbytes() < static_cast<std::size_t>(tensor.nbytes())) {
    throw std::invalid_argument(std::string(who) + ": " + name +
                                " is not whole on this rank (FullyShard frees parameters between "
                                "steps). Fix: gather the records' tensors first "
                                "(record.sharded(mesh).full_tensor()), or save from one process");
  }
  return tensor;
}

// ---- reading peft's adapter_config.json ----------------------------------------------------

struct PeftConfig {
  int64_t r = 8;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  bool use_rslora = false;
  Json target_modules;   // list or string
  Json exclude_modules;  // null, list or string
  std::map<std::string, int64_t> rank_pattern;
  std::map<std::string, double> alpha_pattern;
  std::vector<std::string> modules_to_save;
};

/// A key of the config: null when missing or null.
const Json* config_value(const Json& json, const char* key) {
  const auto it = json.find(key);
  return it == json.end() || it->is_null() ? nullptr : &*it;
}

/// Throws unless the config is a LoRA adapter without the variants d9d does not compute.
void refuse_unsupported(const Json& json, const std::string& who) {
  const auto unsupported = [&](const char* key, const std::string& what) {
    throw std::runtime_error(who + ": \"" + key + "\" = " + json.at(key).dump() + " (" + what +
                             ") is not supported by d9d. Fix: save the adapter with " + key +
                             " at peft's default");
  };
  const auto* type = config_value(json, "peft_type");
  if (type == nullptr || *type != "LORA") {
    throw std::runtime_error(who + ": \"peft_type\" is " + (type ? type->dump() : "missing") +
                             "; d9d loads LoRA adapters only (\"peft_type\": \"LORA\")");
  }
  // Features with their own computation, which d9d does not implement: each must be off.
  for (const char* key : {"use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"}) {
    if (const auto* value = config_value(json, key); value != nullptr && *value != false) {
      unsupported(key, "a LoRA variant");
    }
  }
  if (const auto* bias = config_value(json, "bias"); bias != nullptr && *bias != "none") {
    unsupported("bias", "trained biases");
  }
  for (const char* key :
       {"layers_to_transform", "layers_pattern", "layer_replication", "target_parameters",
        "trainable_token_indices", "megatron_config", "alora_invocation_tokens"}) {
    if (const auto* value = config_value(json, key); value != nullptr &&
                                                     !(value->is_array() && value->empty()) &&
                                                     !(value->is_object() && value->empty())) {
      unsupported(key, "layer selection or a variant");
    }
  }
}

/// The values d9d uses (json::exception on a wrong type).
PeftConfig config_values(const Json& json, const std::string& who) {
  PeftConfig config;
  if (const auto* r = config_value(json, "r")) {
    config.r = r->get<int64_t>();
  }
  if (const auto* alpha = config_value(json, "lora_alpha")) {
    config.lora_alpha = alpha->get<double>();
  }
  if (const auto* dropout = config_value(json, "lora_dropout")) {
    config.lora_dropout = dropout->get<double>();
  }
  if (const auto* rslora = config_value(json, "use_rslora")) {
    config.use_rslora = rslora->get<bool>();
  }
  const auto* targets = config_value(json, "target_modules");
  if (targets == nullptr || !(targets->is_array() || targets->is_string())) {
    throw std::runtime_error(who +
                             ": \"target_modules\" is missing or null (peft then picks defaults "
                             "per model type). Fix: save the adapter with explicit "
                             "target_modules, e.g. [\"q_proj\", \"v_proj\"]");
  }
  config.target_modules = *targets;
  if (const auto* exclude = config_value(json, "exclude_modules")) {
    config.exclude_modules = *exclude;
  }
  if (const auto* ranks = config_value(json, "rank_pattern")) {
    for (const auto& [key, value] : ranks->items()) {
      config.rank_pattern[key] = value.get<int64_t>();
    }
  }
  if (const auto* alphas = config_value(json, "alpha_pattern")) {
    for (const auto& [key, value] : alphas->items()) {
      config.alpha_pattern[key] = value.get<double>();
    }
  }
  if (const auto* save = config_value(json, "modules_to_save")) {
    config.modules_to_save = save->get<std::vector<std::string>>();
  }
  return config;
}

PeftConfig read_config(const std::string& dir) {
  const std::string path = files::join(dir, kConfigFile);
  const std::string who = "d9d::peft::load_adapter: " + path;
  Json json;
  try {
    json = Json::parse(model::read_text_file(path));
  } catch (const Json::parse_error& error) {
    throw std::runtime_error(who + " is not JSON: " + error.what());
  }
  if (!json.is_object()) {
    throw std::runtime_error(who + " is not a JSON object");
  }
  refuse_unsupported(json, who);
  try {
    return config_values(json, who);
  } catch (const Json::exception& error) {
    throw std::runtime_error(who + ": a value has the wrong type: " + error.what());
  }
}

// peft's check_target_module_exists for a module name (0.17: lists match by name or dotted suffix,
// strings as a regular expression over the whole name, "all-linear" every linear layer but the
// output layer; exclude_modules and modules to save are never targets).
bool is_target(const PeftConfig& config, const std::string& name, bool linear) {
  const auto in_list = [&](const Json& names) {
    return std::any_of(names.begin(), names.end(), [&](const Json& item) {
      const auto key = item.get<std::string>();
      return name == key || ends_with(name, "." + key);
    });
  };
  if (config.exclude_modules.is_string()
          ? std::regex_match(name, std::regex(config.exclude_modules.get<std::string>()))
          : (config.exclude_modules.is_array() && in_list(config.exclude_modules))) {
    return false;
  }
  for (const auto& save : config.modules_to_save) {
    if (std::regex_match(name, std::regex("(^|.*\\.)" + save + "($|\\..*)"))) {
      return false;
    }
  }
  if (config.target_modules.is_string()) {
    const auto target = config.target_modules.get<std::string>();
    if (target == "all-linear") {
      return linear && last_component(name) != "lm_head";
    }
    return std::regex_match(name, std::regex(target));
  }
  return in_list(config.target_modules);
}

// peft's get_pattern_key: the first key with (.*\.)?(key)$ matching the name.
template <class T>
T pattern_value(const std::map<std::string, T>& patterns, const std::string& name, T fallback) {
  for (const auto& [key, value] : patterns) {
    if (std::regex_match(name, std::regex("(.*\\.)?(" + key + ")"))) {
      return value;
    }
  }
  return fallback;
}

LoraOptions options_for(const PeftConfig& config, const std::string& name) {
  return {.rank = pattern_value(config.rank_pattern, name, config.r),
          .alpha = pattern_value(config.alpha_pattern, name, config.lora_alpha),
          .dropout = config.lora_dropout,
          .rslora = config.use_rslora};
}

// The file's tensors by model name (the "base_model.model." prefix removed), as views of the map.
std::map<std::string, at::Tensor> read_weights(const std::string& dir, const std::string& who) {
  const std::string path = files::join(dir, kWeightsFile);
  const auto file = state::open_safetensors_as(path, who);
  std::map<std::string, at::Tensor> out;
  std::vector<std::string> foreign;
  for (const auto& entry : file.entries()) {
    const std::string prefix = kPrefix;
    if (entry.name.rfind(prefix, 0) != 0) {
      foreign.push_back(entry.name);
      continue;
    }
    out.emplace(entry.name.substr(prefix.size()), file.view(entry.name));
  }
  if (!foreign.empty()) {
    throw std::runtime_error(who + ": " + path + " has tensors whose names do not start with \"" +
                             std::string(kPrefix) +
                             "\" (peft's prefix): " + util::name_list(foreign));
  }
  return out;
}

// Checks that `tensors` fit the named target shapes: every target has a tensor, every tensor a
// target, the shapes agree.
void check_fit(const std::map<std::string, at::Tensor>& tensors,
               const std::map<std::string, std::vector<int64_t>>& targets, const std::string& who,
               const std::string& path) {
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
  std::vector<std::string> mismatched;
  for (const auto& [name, shape] : targets) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) {
      missing.push_back(kPrefix + name);
    } else if (it->second.sizes() != at::IntArrayRef(shape)) {
      mismatched.push_back(kPrefix + name + " (file " + c10::str(it->second.sizes()) + ", model " +
                           c10::str(at::IntArrayRef(shape)) + ")");
    }
  }
  for (const auto& [name, tensor] : tensors) {
    if (targets.find(name) == targets.end()) {
      unexpected.push_back(kPrefix + name);
    }
  }
  if (const std::string details = util::misfit(
          {{"missing", missing}, {"unexpected", unexpected}, {"other shapes:", mismatched}});
      !details.empty()) {
    throw std::runtime_error(who + ": " + path + " does not fit the model's adapters:" + details +
                             " Fix: load it into the base model it was trained on, with the "
                             "same targets and ranks");
  }
}

// Copies `tensors` into the named targets (views of the model's tensors) after check_fit.
void copy_checked(const std::map<std::string, at::Tensor>& tensors,
                  const std::map<std::string, at::Tensor>& targets, const std::string& who,
                  const std::string& path) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, target] : targets) {
    shapes.emplace(name, target.sizes().vec());
  }
  check_fit(tensors, shapes, who, path);
  const at::NoGradGuard no_grad;
  for (const auto& [name, target] : targets) {
    at::Tensor(target).copy_(tensors.at(name));
  }
}

// An empty module tree holding `parameters` under their dotted names (sharing their storage), so
// that save_hf_checkpoint writes exactly these.
std::shared_ptr<torch::nn::Module> tree_of(
    const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
  auto root = std::make_shared<torch::nn::Module>();
  std::map<std::string, std::shared_ptr<torch::nn::Module>> made{{"", root}};
  for (const auto& [name, tensor] : parameters) {
    std::string path;
    auto parent = root;
    std::size_t start = 0;
    for (auto dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
      const auto part = name.substr(start, dot - start);
      path += (path.empty() ? "" : ".") + part;
      auto it = made.find(path);
      if (it == made.end()) {
        auto child = std::make_shared<torch::nn::Module>();
        parent->register_module(part, child);
        it = made.emplace(path, child).first;
      }
      parent = it->second;
      start = dot + 1;
    }
    parent->register_parameter(name.substr(start), tensor.detach(), /*requires_grad=*/false);
  }
  return root;
}

class UnmergeOnExit {
 public:
  explicit UnmergeOnExit(torch::nn::Module& model) : model_(model) {}
  UnmergeOnExit(const UnmergeOnExit&) = delete;
  UnmergeOnExit& operator=(const UnmergeOnExit&) = delete;
  UnmergeOnExit(UnmergeOnExit&&) = delete;
  UnmergeOnExit& operator=(UnmergeOnExit&&) = delete;
  ~UnmergeOnExit() {
    if (armed_) {
      unmerge(model_);
    }
  }
  void arm() { armed_ = true; }

 private:
  torch::nn::Module& model_;
  bool armed_ = false;
};

}  // namespace

std::vector<std::string> AdapterContents::tensor_names() const {
  std::set<std::string> adapter_names;
  std::vector<std::string> out;
  for (const auto& layer : layers) {
    for (const auto& name : factor_names(layer)) {
      adapter_names.insert(name);
      out.push_back(name);
    }
  }
  // Other parameters that train go along as peft's modules_to_save: every parameter of their
  // modules (peft replaces the whole module with the saved copy).
  std::set<std::string> to_save;
  for (const auto& [name, trains] : parameters) {
    if (trains && adapter_names.count(name) == 0) {
      to_save.insert(owner_of(name));
    }
  }
  for (const auto& [name, trains] : parameters) {
    if (adapter_names.count(name) == 0 && to_save.count(owner_of(name)) > 0) {
      out.push_back(name);
    }
  }
  return out;
}

void AdapterContents::merge(const AdapterContents& other) {
  const auto append_new = [](auto& into, const auto& from, const auto& key) {
    for (const auto& item : from) {
      if (std::none_of(into.begin(), into.end(),
                       [&](const auto& known) { return key(known) == key(item); })) {
        into.push_back(item);
      }
    }
  };
  append_new(layers, other.layers, [](const Layer& l) { return l.name; });
  append_new(modules, other.modules, [](const std::string& m) { return m; });
  append_new(parameters, other.parameters,
             [](const std::pair<std::string, bool>& p) { return p.first; });
}

std::string AdapterContents::to_json() const {
  Json out = {{"layers", Json::array()}, {"modules", modules}, {"parameters", Json::array()}};
  for (const auto& layer : layers) {
    const auto& o = layer.options;
    out["layers"].push_back({layer.name, o.rank, o.alpha, o.dropout, o.rslora, layer.experts});
  }
  for (const auto& [name, trains] : parameters) {
    out["parameters"].push_back({name, trains});
  }
  return out.dump();
}

AdapterContents AdapterContents::from_json(const std::string& text) {
  const auto json = Json::parse(text);
  AdapterContents out;
  for (const auto& layer : json.at("layers")) {
    out.layers.push_back({.name = layer.at(0).get<std::string>(),
                          .options = {.rank = layer.at(1).get<int64_t>(),
                                      .alpha = layer.at(2).get<double>(),
                                      .dropout = layer.at(3).get<double>(),
                                      .rslora = layer.at(4).get<bool>()},
                          .experts = layer.at(5).get<int64_t>()});
  }
  out.modules = json.at("modules").get<std::vector<std::string>>();
  for (const auto& parameter : json.at("parameters")) {
    out.parameters.emplace_back(parameter.at(0).get<std::string>(), parameter.at(1).get<bool>());
  }
  return out;
}

AdapterContents adapter_contents(const torch::nn::Module& model) {
  AdapterContents out;
  for (const auto& layer : lora_layers(model)) {
    out.layers.push_back(
        {.name = layer.name, .options = layer.options(), .experts = layer.num_experts()});
  }
  for (const auto& [name, module] : module_names(model)) {
    out.modules.push_back(name);
    // The experts' projections count as layers of their kind ("gate_proj" names them in peft's
    // per-expert layout).
    if (dynamic_cast<const model::GroupedExpertsImpl*>(module.get()) != nullptr) {
      for (const auto projection : model::GroupedExpertsImpl::projections) {
        out.modules.push_back(name + "." + std::string(projection));
      }
    }
  }
  for (const auto& item : model.named_parameters()) {
    out.parameters.emplace_back(item.key(), item.value().requires_grad());
  }
  return out;
}

void save_adapter(const torch::nn::Module& model, const std::string& dir,
                  const AdapterExportOptions& options) {
  const char* who = "d9d::peft::save_adapter";
  const auto named = model.named_parameters();
  save_adapter(
      adapter_contents(model), dir,
      [&](const std::string& name) {
        const auto& local = named[name];
        return options.whole_tensor ? options.whole_tensor(name, local) : whole(local, name, who);
      },
      options);
}

namespace {

/// peft's target_modules: a layer's last name component when every module of that name is
/// adapted ("q_proj"), else the full names; either way peft adapts exactly these layers.
std::vector<std::string> target_modules(const AdapterContents& contents,
                                        const std::set<std::string>& adapted) {
  std::vector<std::string> targets;
  for (const auto& layer : contents.layers) {
    const auto last = last_component(layer.name);
    const bool all_of_kind =
        std::all_of(contents.modules.begin(), contents.modules.end(), [&](const auto& module) {
          const bool same = module == last || ends_with(module, "." + last);
          return !same || adapted.count(module) > 0;
        });
    std::vector<std::string> names;
    if (all_of_kind) {
      names.push_back(last);
    } else if (layer.experts > 0) {
      for (int64_t e = 0; e < layer.experts; ++e) {
        names.push_back(expert_module(layer.name, e));
      }
    } else {
      names.push_back(layer.name);
    }
    for (auto& target : names) {
      if (std::find(targets.begin(), targets.end(), target) == targets.end()) {
        targets.push_back(std::move(target));
      }
    }
  }
  return targets;
}

/// peft's rank_pattern / alpha_pattern key for a layer: its name as a regular expression (every
/// expert's module "<experts>.<e>.<projection>" for an expert projection).
std::string pattern_key(const AdapterContents::Layer& layer) {
  if (layer.experts > 0) {
    return regex_escape(owner_of(layer.name)) + "\\.[0-9]+\\." +
           regex_escape(last_component(layer.name));
  }
  return regex_escape(layer.name);
}

/// peft's adapter_config.json for adapters of `first`'s options but the patterns.
Json peft_config(const LoraOptions& first, const Json& rank_pattern, const Json& alpha_pattern,
                 const std::vector<std::string>& modules_to_save,
                 const std::vector<std::string>& targets, const AdapterExportOptions& options) {
  const auto text_or_null = [](const std::string& text) {
    return text.empty() ? Json(nullptr) : Json(text);
  };
  return {
      {"alpha_pattern", alpha_pattern},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path", text_or_null(options.base_model_name_or_path)},
      {"bias", "none"},
      {"exclude_modules", nullptr},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layer_replication", nullptr},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", number(first.alpha)},
      {"lora_bias", false},
      {"lora_dropout", first.dropout},
      {"modules_to_save", modules_to_save.empty() ? Json(nullptr) : Json(modules_to_save)},
      {"peft_type", "LORA"},
      {"r", first.rank},
      {"rank_pattern", rank_pattern},
      {"revision", nullptr},
      {"target_modules", targets},
      {"task_type", text_or_null(options.task_type)},
      {"use_dora", false},
      {"use_rslora", first.rslora},
  };
}

// The options of an expert projection's adapter in a peft file (`experts` experts), or none when
// the file targets none of them. d9d adapts all of a projection's experts or none, with one rank
// and scale and no dropout: std::runtime_error otherwise.
std::optional<LoraOptions> expert_options(const PeftConfig& config, const std::string& projection,
                                          int64_t experts, const std::string& who) {
  int64_t hit = 0;
  for (int64_t e = 0; e < experts; ++e) {
    hit += is_target(config, expert_module(projection, e), /*linear=*/true) ? 1 : 0;
  }
  if (hit == 0) {
    return std::nullopt;
  }
  const auto options = options_for(config, expert_module(projection, 0));
  bool alike = true;
  for (int64_t e = 1; e < experts && alike; ++e) {
    const auto here = options_for(config, expert_module(projection, e));
    alike = here.rank == options.rank && here.alpha == options.alpha;
  }
  if (hit != experts || !alike) {
    throw std::runtime_error(who + ": the adapter targets " + std::to_string(hit) + " of the " +
                             std::to_string(experts) + " experts of " + projection +
                             " or gives them different ranks or alphas; d9d adapts every expert "
                             "of a projection alike (stacked factors). Fix: target all of them "
                             "with one rank");
  }
  if (options.dropout > 0.0) {
    throw std::runtime_error(who + ": \"lora_dropout\" = " + std::to_string(options.dropout) +
                             " on the experts of " + projection +
                             "; d9d's expert adapters take no dropout. Fix: save the adapter "
                             "with lora_dropout 0");
  }
  return options;
}

}  // namespace

void save_adapter(const AdapterContents& contents, const std::string& dir,
                  const std::function<at::Tensor(const std::string& name)>& tensor,
                  const AdapterExportOptions& options) {
  const char* who = "d9d::peft::save_adapter";
  const auto& layers = contents.layers;
  if (layers.empty()) {
    throw std::invalid_argument(std::string(who) +
                                ": the model has no LoRA adapter. Fix: train it with a plan whose "
                                "peft slot has a d9d::peft::Lora, or d9d::peft::apply_stack");
  }
  const auto& first = layers.front().options;
  Json rank_pattern = Json::object();
  Json alpha_pattern = Json::object();
  // Each adapter tensor's key in the file ("<layer>.lora_A.weight"), or, for an expert
  // projection's stacked one, the key of each expert's slice
  // ("<experts>.<e>.gate_proj.lora_A.weight").
  std::map<std::string, std::vector<std::string>> adapter_keys;
  for (const auto& layer : layers) {
    const auto& o = layer.options;
    if (o.rslora != first.rslora) {
      throw std::invalid_argument(std::string(who) + ": " + layer.name +
                                  " mixes rsLoRA and plain scaling with " + layers.front().name +
                                  "; peft's use_rslora holds for every layer");
    }
    if (o.rank != first.rank) {
      rank_pattern[pattern_key(layer)] = o.rank;
    }
    if (o.alpha != first.alpha) {
      alpha_pattern[pattern_key(layer)] = number(o.alpha);
    }
    const auto names = factor_names(layer);
    for (std::size_t f = 0; f < names.size(); ++f) {
      const std::string suffix = f == 0 ? ".lora_A.weight" : ".lora_B.weight";
      auto& keys = adapter_keys[names.at(f)];
      if (layer.experts == 0) {
        keys.push_back(kPrefix + layer.name + suffix);
      }
      for (int64_t e = 0; e < layer.experts; ++e) {
        keys.push_back(kPrefix + expert_module(layer.name, e) + suffix);
      }
    }
  }
  state::NamedTensors tensors;
  std::vector<std::string> modules_to_save;
  std::set<std::string> adapted;
  for (const auto& layer : layers) {
    adapted.insert(layer.name);
  }
  for (const auto& name : contents.tensor_names()) {
    const auto value = tensor(name).detach().to(at::kCPU, options.dtype);
    const auto keys = adapter_keys.find(name);
    if (keys == adapter_keys.end()) {
      tensors.emplace_back(kPrefix + name, value);
      const auto owner = owner_of(name);
      if (std::find(modules_to_save.begin(), modules_to_save.end(), owner) ==
          modules_to_save.end()) {
        modules_to_save.push_back(owner);
      }
    } else if (keys->second.size() == 1 && value.dim() == 2) {
      tensors.emplace_back(keys->second.front(), value);
    } else {
      if (value.dim() != 3 || value.size(0) != static_cast<int64_t>(keys->second.size())) {
        throw std::invalid_argument(std::string(who) + ": " + name + " is " +
                                    c10::str(value.sizes()) + ", not the stacked factors of " +
                                    std::to_string(keys->second.size()) +
                                    " experts (is the tensor whole?)");
      }
      for (std::size_t e = 0; e < keys->second.size(); ++e) {
        tensors.emplace_back(keys->second[e],
                             value.select(0, static_cast<int64_t>(e)).contiguous());
      }
    }
  }

  const Json config = peft_config(first, rank_pattern, alpha_pattern, modules_to_save,
                                  target_modules(contents, adapted), options);
  files::create_directories(dir, who);
  state::save_safetensors(files::join(dir, kWeightsFile), tensors, {{"format", "pt"}});
  write_text_file(files::join(dir, kConfigFile), config.dump(2) + "\n");
}

void load_adapter(torch::nn::Module& model, const std::string& dir) {
  const std::string who = "d9d::peft::load_adapter";
  if (has_lora(model)) {
    throw std::invalid_argument(who +
                                ": the model has adapters already. Fix: "
                                "d9d::peft::load_adapter_weights copies a file into them");
  }
  const auto config = read_config(dir);
  const auto tensors = read_weights(dir, who);
  const auto modules = module_names(model);
  std::vector<std::pair<std::string, model::LinearImpl*>> targets;
  // Expert projections peft adapts expert by expert ("<experts>.<e>.gate_proj"): d9d adapts all
  // of a projection's experts or none, with one rank and scale.
  struct ExpertTarget {
    std::string name;  // "<experts>.gate_proj"
    model::GroupedExpertsImpl* experts;
    std::size_t index;
    LoraOptions options;
  };
  std::vector<ExpertTarget> expert_targets;
  for (const auto& [name, module] : modules) {
    if (auto* experts = dynamic_cast<model::GroupedExpertsImpl*>(module.get())) {
      for (std::size_t p = 0; p < model::GroupedExpertsImpl::projections.size(); ++p) {
        const auto projection = name + "." + std::string(model::GroupedExpertsImpl::projections[p]);
        const auto options = expert_options(config, projection, experts->num_experts(), who);
        if (!options) {
          continue;
        }
        expert_targets.push_back({projection, experts, p, *options});
      }
      continue;
    }
    auto* layer = dynamic_cast<model::LinearImpl*>(module.get());
    if (!is_target(config, name, layer != nullptr)) {
      continue;
    }
    if (layer == nullptr) {
      // peft adapts containers' children, not containers; a non-linear leaf is an error there.
      if (module->children().empty()) {
        throw std::runtime_error(who + ": the adapter targets " + name +
                                 ", which is not a linear layer (d9d adapts d9d::model::Linear "
                                 "and the grouped experts' projections only)");
      }
      continue;
    }
    targets.emplace_back(name, layer);
  }
  if (targets.empty() && expert_targets.empty()) {
    throw std::runtime_error(who + ": target_modules " + config.target_modules.dump() +
                             " matches no linear layer of the model. Fix: load the adapter into "
                             "the model it was trained for");
  }
  // Every tensor's shape is checked before the model changes.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, layer] : targets) {
    const auto rank = options_for(config, name).rank;
    shapes[name + ".lora_A.weight"] = {rank, layer->in_features()};
    shapes[name + ".lora_B.weight"] = {layer->out_features(), rank};
  }
  for (const auto& target : expert_targets) {
    const auto& weight = target.experts->projection(target.index);
    for (int64_t e = 0; e < target.experts->num_experts(); ++e) {
      shapes[expert_module(target.name, e) + ".lora_A.weight"] = {target.options.rank,
                                                                  weight.size(2)};
      shapes[expert_module(target.name, e) + ".lora_B.weight"] = {weight.size(1),
                                                                  target.options.rank};
    }
  }
  // Modules to save: every parameter of a module whose name ends with an entry (peft's rule, a
  // plain suffix).
  std::map<std::string, at::Tensor> destinations;
  for (const auto& item : model.named_parameters()) {
    const auto owner = owner_of(item.key());
    for (const auto& save : config.modules_to_save) {
      if (ends_with(owner, save)) {
        destinations[item.key()] = item.value();
        shapes[item.key()] = item.value().sizes().vec();
      }
    }
  }
  check_fit(tensors, shapes, who, files::join(dir, kWeightsFile));
  for (const auto& [name, layer] : targets) {
    auto adapter = std::make_shared<LoraAdapter>(*layer, options_for(config, name), 0, name);
    destinations[name + ".lora_A.weight"] = adapter->lora_A->weight;
    destinations[name + ".lora_B.weight"] = adapter->lora_B->weight;
    layer->adapter = adapter;
  }
  for (const auto& target : expert_targets) {
    auto adapter = std::make_shared<ExpertLoraAdapter>(*target.experts, target.index,
                                                       target.options, 0, target.name);
    for (int64_t e = 0; e < target.experts->num_experts(); ++e) {
      destinations[expert_module(target.name, e) + ".lora_A.weight"] = adapter->lora_A.select(0, e);
      destinations[expert_module(target.name, e) + ".lora_B.weight"] = adapter->lora_B.select(0, e);
    }
    target.experts->adapters.at(target.index) = adapter;
  }
  copy_checked(tensors, destinations, who, files::join(dir, kWeightsFile));
  for (auto& parameter : model.parameters()) {
    parameter.requires_grad_(false);
  }
}

void load_adapter_weights(torch::nn::Module& model, const std::string& dir) {
  const std::string who = "d9d::peft::load_adapter_weights";
  const auto layers = lora_layers(model);
  if (layers.empty()) {
    throw std::invalid_argument(who +
                                ": the model has no adapter. Fix: d9d::peft::load_adapter adds "
                                "the file's adapters to a plain model");
  }
  const auto config = read_config(dir);
  std::map<std::string, at::Tensor> destinations;
  for (const auto& layer : layers) {
    const int64_t experts = layer.num_experts();
    const auto want = options_for(config, experts > 0 ? expert_module(layer.name, 0) : layer.name);
    const auto& have = layer.options();
    if (want.rank != have.rank || std::abs(want.scale() - have.scale()) > 1e-12 * have.scale()) {
      throw std::runtime_error(who + ": " + layer.name + " has rank " + std::to_string(have.rank) +
                               " and scale " + std::to_string(have.scale()) + ", the file rank " +
                               std::to_string(want.rank) + " and scale " +
                               std::to_string(want.scale()) +
                               ". Fix: build the model with the adapter's rank and alpha");
    }
    if (experts == 0) {
      destinations[layer.a_name()] = layer.adapter->lora_A->weight;
      destinations[layer.b_name()] = layer.adapter->lora_B->weight;
      continue;
    }
    const auto& a = layer.expert_adapter->lora_A;
    if (a.size(0) != experts) {
      throw std::invalid_argument(who + ": " + layer.name + " holds " + std::to_string(a.size(0)) +
                                  " of its " + std::to_string(experts) +
                                  " experts here (expert parallelism). Fix: load the adapter "
                                  "into the whole model, then parallelize");
    }
    for (int64_t e = 0; e < experts; ++e) {
      destinations[expert_module(layer.name, e) + ".lora_A.weight"] = a.select(0, e);
      destinations[expert_module(layer.name, e) + ".lora_B.weight"] =
          layer.expert_adapter->lora_B.select(0, e);
    }
  }
  const auto tensors = read_weights(dir, who);
  const auto parameters = model.named_parameters();
  for (const auto& [name, tensor] : tensors) {
    if (destinations.count(name) == 0 && parameters.find(name) != nullptr) {
      destinations[name] = parameters[name];  // a module to save
    }
  }
  copy_checked(tensors, destinations, who, files::join(dir, kWeightsFile));
}

void save_merged_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                               const std::string& config_json, at::ScalarType dtype) {
  const auto layers = lora_layers(model);
  const auto adapter_names = adapter_parameter_names(layers);
  std::vector<std::string> merged_here;
  for (const auto& layer : layers) {
    if (!layer.merged()) {
      merged_here.push_back(layer.name);
    }
  }
  UnmergeOnExit restore(model);  // unmerges what this call merged, also when saving throws
  if (!merged_here.empty()) {
    if (merged_here.size() != layers.size()) {
      throw std::invalid_argument(
          "d9d::peft::save_merged_hf_checkpoint: some adapters are merged already, others not. "
          "Fix: d9d::peft::unmerge(model) first");
    }
    merge(model);
    restore.arm();
  }
  std::vector<std::pair<std::string, at::Tensor>> base;
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters()) {
    if (adapter_names.count(item.key()) == 0) {
      base.emplace_back(item.key(), item.value());
      names.push_back(item.key());
    }
  }
  // Qwen3-MoE's stacked experts go out as transformers' per-expert tensors.
  if (const auto* moe = dynamic_cast<const model::Qwen3MoeForCausalLMImpl*>(&model)) {
    model::save_hf_mapped(model, model::qwen3_moe_hf_export_mapper(moe->config(), names), dir,
                          config_json, dtype);
    return;
  }
  model::save_hf_checkpoint(*tree_of(base), dir, config_json, dtype);
}

}  // namespace d9d::peft
