// d9d/model/qwen3_moe_config.cpp — Qwen3MoeConfig: the MoE keys of a transformers 4 / 5
// config.json, the rest through the dense Qwen3 reader (so both follow the same rules), validation,
// export.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <d9d/model/detail/config_reader.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/model/stage_layers.hpp>

namespace d9d::model {
namespace {

using detail::find;
using detail::in_quotes;
using detail::Json;
using detail::shown;

constexpr detail::ConfigReader kReader{"d9d Qwen3-MoE config: "};
constexpr detail::ConfigReader kDenseReader{"d9d Qwen3 config: "};
constexpr int64_t kMaxSize = detail::kMaxConfigSize;

/// The MoE keys this reader takes out before the dense Qwen3 reader sees the rest.
constexpr std::string_view kMoeKeys[] = {"num_experts",
                                         "num_local_experts",
                                         "num_experts_per_tok",
                                         "moe_intermediate_size",
                                         "norm_topk_prob",
                                         "decoder_sparse_step",
                                         "mlp_only_layers",
                                         "router_aux_loss_coef",
                                         "output_router_logits",
                                         "shared_expert_intermediate_size",
                                         "router_bias_update_rate",
                                         "router_bias_update_rule",
                                         "router_aux_loss_type",
                                         "moe_capacity_factor"};

[[noreturn]] void fail(const std::string& message) { kReader.fail(message); }

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& valid) {
  kReader.bad(key, value, valid);
}

bool is_moe_key(std::string_view key) {
  return std::find(std::begin(kMoeKeys), std::end(kMoeKeys), key) != std::end(kMoeKeys);
}

int64_t read_size(const Json& value, const std::string& key, int64_t low = 1) {
  return kReader.read_size(value, key, low);
}

double read_non_negative(const Json& value, const std::string& key) {
  if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0) {
    bad(key, shown(value), "expected a finite number >= 0");
  }
  return value.get<double>();
}

bool read_bool(const Json& value, const std::string& key) { return kReader.read_bool(value, key); }

void reject_unknown_keys(const Json& json) {
  std::vector<std::string_view> known(std::begin(kMoeKeys), std::end(kMoeKeys));
  const auto dense = detail::qwen3_config_keys();
  known.insert(known.end(), dense.begin(), dense.end());
  kReader.reject_unknown_keys(
      json, known,
      "; d9d reads the dense Qwen3 keys (d9d/model/qwen3.hpp) and the MoE keys "
      "num_experts (or num_local_experts), num_experts_per_tok, moe_intermediate_size, "
      "norm_topk_prob, decoder_sparse_step, mlp_only_layers, router_aux_loss_coef, "
      "output_router_logits, shared_expert_intermediate_size, router_bias_update_rate, "
      "router_bias_update_rule, router_aux_loss_type, moe_capacity_factor");
}

// The experts' counts and sizes, which have no defaults: num_experts (or transformers 5's
// num_local_experts, agreeing when both are given), num_experts_per_tok, moe_intermediate_size.
void read_expert_counts(const Json& json, Qwen3MoeConfig& config) {
  const Json* experts = find(json, "num_experts");
  const Json* local = find(json, "num_local_experts");
  if (experts == nullptr && local == nullptr) {
    fail(
        "missing required key \"num_experts\" (transformers 4's name; transformers 5 writes "
        "\"num_local_experts\")");
  }
  if (experts != nullptr && local != nullptr &&
      read_size(*experts, "num_experts") != read_size(*local, "num_local_experts")) {
    fail("\"num_experts\" = " + shown(*experts) + " and \"num_local_experts\" = " + shown(*local) +
         " disagree (transformers 5 reads num_local_experts, 4 reads num_experts). Fix: give "
         "the count once");
  }
  config.num_experts = experts != nullptr ? read_size(*experts, "num_experts")
                                          : read_size(*local, "num_local_experts");
  std::string missing;
  for (const char* key : {"num_experts_per_tok", "moe_intermediate_size"}) {
    if (find(json, key) == nullptr) {
      missing += (missing.empty() ? "" : ", ") + in_quotes(key);
    }
  }
  if (!missing.empty()) {
    fail("missing required key(s) " + missing + "; d9d has no defaults for the model's shape");
  }
  config.num_experts_per_tok = read_size(*find(json, "num_experts_per_tok"), "num_experts_per_tok");
  config.moe_intermediate_size =
      read_size(*find(json, "moe_intermediate_size"), "moe_intermediate_size");
}

// One of a key's named values (the message lists them all).
template <class Enum, std::size_t N>
Enum read_choice(const Json& value, const std::string& key,
                 const std::pair<const char*, Enum> (&choices)[N]) {
  std::string names;
  for (const auto& [name, choice] : choices) {
    if (value.is_string() && value == name) {
      return choice;
    }
    names += (names.empty() ? "" : " or ") + in_quotes(name);
  }
  bad(key, shown(value), "expected " + names);
}

}  // namespace

Qwen3MoeConfig Qwen3MoeConfig::from_json_text(const std::string& text) {
  const Json json = kReader.parse_object(text);
  if (const Json* type = find(json, "model_type"); type != nullptr && *type != "qwen3_moe") {
    bad("model_type", shown(*type),
        *type == "qwen3"
            ? "this reader is Qwen3-MoE's (\"qwen3_moe\"); read dense Qwen3 configs with "
              "d9d::model::Qwen3Config (the trainer's d9d::Qwen3Provider)"
            : "d9d reads Qwen3-MoE configs (\"qwen3_moe\") only; other MoE families (e.g. "
              "\"qwen2_moe\", with attention biases and no QK-norm) are not implemented");
  }
  reject_unknown_keys(json);

  // The dense part through the dense reader (its rules, its messages under this prefix).
  Json dense = Json::object();
  for (const auto& item : json.items()) {
    if (!is_moe_key(item.key())) {
      dense[item.key()] = item.value();
    }
  }
  if (dense.contains("model_type")) {
    dense["model_type"] = "qwen3";
  }
  Qwen3MoeConfig config;
  static_cast<Qwen3Config&>(config) = kReader.under_own_prefix(
      kDenseReader, [&dense] { return Qwen3Config::from_json_text(dense.dump()); });

  // The MoE keys.
  read_expert_counts(json, config);
  if (const Json* v = find(json, "norm_topk_prob")) {
    config.norm_topk_prob = read_bool(*v, "norm_topk_prob");
  }
  if (const Json* v = find(json, "decoder_sparse_step")) {
    config.decoder_sparse_step = read_size(*v, "decoder_sparse_step");
  }
  if (const Json* v = find(json, "mlp_only_layers")) {
    if (!v->is_array()) {
      bad("mlp_only_layers", shown(*v), "expected a list of layer indices");
    }
    for (std::size_t i = 0; i < v->size(); ++i) {
      config.mlp_only_layers.push_back(
          read_size((*v)[i], "mlp_only_layers[" + std::to_string(i) + "]", 0));
    }
  }
  if (const Json* v = find(json, "router_aux_loss_coef")) {
    config.router_aux_loss_coef = read_non_negative(*v, "router_aux_loss_coef");
  }
  if (const Json* v = find(json, "output_router_logits")) {
    config.output_router_logits = read_bool(*v, "output_router_logits");
  }
  if (const Json* v = find(json, "shared_expert_intermediate_size")) {
    config.shared_expert_intermediate_size =
        read_size(*v, "shared_expert_intermediate_size", /*low=*/0);
  }
  if (const Json* v = find(json, "router_bias_update_rate")) {
    config.router_bias_update_rate = read_non_negative(*v, "router_bias_update_rate");
  }
  if (const Json* v = find(json, "router_bias_update_rule")) {
    config.router_bias_update_rule = read_choice<MoeBiasRule>(
        *v, "router_bias_update_rule",
        {{"sign", MoeBiasRule::sign}, {"proportional", MoeBiasRule::proportional}});
  }
  if (const Json* v = find(json, "moe_capacity_factor")) {
    config.moe_capacity_factor = read_non_negative(*v, "moe_capacity_factor");
  }
  if (const Json* v = find(json, "router_aux_loss_type")) {
    config.router_aux_loss_type = read_choice<MoeAuxLoss>(
        *v, "router_aux_loss_type",
        {{"global_batch", MoeAuxLoss::global_batch}, {"sequence", MoeAuxLoss::sequence}});
  }
  config.validate();
  return config;
}

void Qwen3MoeConfig::validate() const {
  kReader.under_own_prefix(kDenseReader, [this] { Qwen3Config::validate(); });
  const std::pair<const char*, int64_t> sizes[] = {{"num_experts", num_experts},
                                                   {"num_experts_per_tok", num_experts_per_tok},
                                                   {"moe_intermediate_size", moe_intermediate_size},
                                                   {"decoder_sparse_step", decoder_sparse_step}};
  for (const auto& [key, value] : sizes) {
    if (value < 1 || value > kMaxSize) {
      bad(key, std::to_string(value),
          "it must be an integer from 1 to " + std::to_string(kMaxSize));
    }
  }
  if (num_experts_per_tok > num_experts) {
    bad("num_experts_per_tok", std::to_string(num_experts_per_tok),
        "a token cannot go to more experts than there are (num_experts = " +
            std::to_string(num_experts) + ")");
  }
  for (std::size_t i = 0; i < mlp_only_layers.size(); ++i) {
    if (mlp_only_layers[i] < 0 || mlp_only_layers[i] >= num_hidden_layers) {
      bad("mlp_only_layers[" + std::to_string(i) + "]", std::to_string(mlp_only_layers[i]),
          "layer indices go from 0 to num_hidden_layers - 1 = " +
              std::to_string(num_hidden_layers - 1));
    }
  }
  if (shared_expert_intermediate_size < 0 || shared_expert_intermediate_size > kMaxSize) {
    bad("shared_expert_intermediate_size", std::to_string(shared_expert_intermediate_size),
        "it must be 0 (no shared expert) or a size up to " + std::to_string(kMaxSize));
  }
  const std::pair<const char*, double> rates[] = {
      {"router_aux_loss_coef", router_aux_loss_coef},
      {"router_bias_update_rate", router_bias_update_rate},
      {"moe_capacity_factor", moe_capacity_factor}};
  for (const auto& [key, value] : rates) {
    if (!(value >= 0) || !std::isfinite(value)) {
      bad(key, std::to_string(value), "it must be a finite number >= 0");
    }
  }
}

bool Qwen3MoeConfig::is_moe_layer(int64_t layer) const {
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) ==
             mlp_only_layers.end() &&
         num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

MoeOptions Qwen3MoeConfig::moe_options() const {
  return {.hidden_size = hidden_size,
          .num_experts = num_experts,
          .top_k = num_experts_per_tok,
          .intermediate_size = moe_intermediate_size,
          .norm_topk_prob = norm_topk_prob,
          .shared_expert_intermediate_size = shared_expert_intermediate_size,
          .bias_update_rate = router_bias_update_rate,
          .bias_update_rule = router_bias_update_rule,
          .capacity_factor = moe_capacity_factor};
}

double Qwen3MoeConfig::aux_loss_coef() const {
  return output_router_logits ? router_aux_loss_coef : 0.0;
}

std::string Qwen3MoeConfig::to_hf_json(const std::string& torch_dtype) const {
  auto json = nlohmann::ordered_json::parse(Qwen3Config::to_hf_json(torch_dtype));
  json["architectures"] = {"Qwen3MoeForCausalLM"};
  json["model_type"] = "qwen3_moe";
  json["num_experts"] = num_experts;
  json["num_experts_per_tok"] = num_experts_per_tok;
  json["moe_intermediate_size"] = moe_intermediate_size;
  json["norm_topk_prob"] = norm_topk_prob;
  json["decoder_sparse_step"] = decoder_sparse_step;
  json["mlp_only_layers"] = mlp_only_layers;
  json["router_aux_loss_coef"] = router_aux_loss_coef;
  json["output_router_logits"] = output_router_logits;
  if (shared_expert_intermediate_size > 0) {
    json["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  }
  if (router_bias_update_rate > 0) {
    json["router_bias_update_rate"] = router_bias_update_rate;
    json["router_bias_update_rule"] =
        router_bias_update_rule == MoeBiasRule::proportional ? "proportional" : "sign";
  }
  if (router_aux_loss_type == MoeAuxLoss::sequence) {
    json["router_aux_loss_type"] = "sequence";
  }
  if (moe_capacity_factor > 0) {
    json["moe_capacity_factor"] = moe_capacity_factor;
  }
  return json.dump(2) + "\n";
}

int64_t Qwen3MoeConfig::active_non_embedding_parameter_count() const {
  const int64_t attention = hidden_size * num_attention_heads * head_dim +
                            2 * hidden_size * num_key_value_heads * head_dim +
                            num_attention_heads * head_dim * hidden_size + 2 * head_dim;
  int64_t total = hidden_size;  // the final norm
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    total += attention + 2 * hidden_size;
    if (is_moe_layer(layer)) {
      total +=
          num_experts * hidden_size + num_experts_per_tok * 3 * hidden_size * moe_intermediate_size;
      if (shared_expert_intermediate_size > 0) {
        total += 3 * hidden_size * shared_expert_intermediate_size + hidden_size;
      }
    } else {
      total += 3 * hidden_size * intermediate_size;
    }
  }
  return total;
}

VirtualLayers pipeline_virtual_layers(const Qwen3MoeConfig& config, int64_t sequence_length) {
  const int64_t layers = std::max<int64_t>(config.num_hidden_layers, 1);
  const auto per_layer =
      static_cast<double>(config.active_non_embedding_parameter_count() - config.hidden_size) /
      static_cast<double>(layers);
  return detail::qwen3_virtual_layers(config, per_layer, sequence_length);
}

int64_t Qwen3MoeConfig::active_parameter_count() const {
  return active_non_embedding_parameter_count() +
         vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
}

int64_t Qwen3MoeConfig::parameter_count() const {
  int64_t inactive = 0;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    if (is_moe_layer(layer)) {
      inactive += (num_experts - num_experts_per_tok) * 3 * hidden_size * moe_intermediate_size;
    }
  }
  return active_parameter_count() + inactive;
}

}  // namespace d9d::model
