// d9d/model/qwen3_config.cpp — Qwen3Config: reading config.json as transformers 4 and 5 write it,
// validation, export.
//
// Every key of a config is in exactly one of four groups (the tables below, documented in
// d9d/model/qwen3.hpp): read into Qwen3Config, accepted only with the value d9d's Qwen3 computes
// with, rejected whenever set, or accepted and ignored because it does not change what the model
// computes. Anything else is an unknown key. Reading never falls back to a default for the model's
// shape, so a config d9d does not understand cannot load as a different model.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <d9d/model/detail/config_reader.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/stage_layers.hpp>

namespace d9d::model {
namespace {

using detail::find;
using detail::in_quotes;
using detail::Json;
using detail::shown;

constexpr detail::ConfigReader kReader{"d9d Qwen3 config: "};
constexpr int64_t kMaxSize = detail::kMaxConfigSize;

/// Keys read into Qwen3Config (the rope theta from "rope_theta" or from inside "rope_parameters" /
/// "rope_scaling"). Listed first: they win ties of the did-you-mean suggestion.
constexpr std::string_view kReadKeys[] = {"vocab_size",
                                          "hidden_size",
                                          "intermediate_size",
                                          "num_hidden_layers",
                                          "num_attention_heads",
                                          "num_key_value_heads",
                                          "head_dim",
                                          "rms_norm_eps",
                                          "rope_theta",
                                          "rope_parameters",
                                          "rope_scaling",
                                          "tie_word_embeddings",
                                          "max_position_embeddings",
                                          "initializer_range"};

/// The keys a config must give: d9d has no default for the model's shape.
constexpr std::string_view kRequiredKeys[] = {
    "vocab_size",          "hidden_size",         "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim",          "rms_norm_eps"};

/// Keys that change the model, accepted only with the value d9d's Qwen3 implements.
constexpr std::string_view kCheckedKeys[] = {"model_type",
                                             "hidden_act",
                                             "attention_bias",
                                             "attention_dropout",
                                             "use_sliding_window",
                                             "layer_types",
                                             "pruned_heads",
                                             "is_encoder_decoder",
                                             "add_cross_attention",
                                             "tie_encoder_decoder",
                                             "cross_attention_hidden_size"};

/// Keys that change the model and that d9d rejects whenever they are set (not null).
constexpr std::string_view kRejectedKeys[] = {"quantization_config", "auto_map"};

/// Keys accepted and ignored: they do not change what the model computes. Transformers'
/// PretrainedConfig (4.57) / PreTrainedConfig (5.x) write them, or Qwen3Config does.
constexpr std::string_view kIgnoredKeys[] = {
    // Provenance and storage: the loader converts every tensor to its parameter's dtype.
    "architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    // Token ids, for tokenizers and generation. (transformers makes pad_token_id the embedding's
    // padding_idx, which only zeroes that row's gradient in training; d9d trains it like any
    // other.)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    // Inference and generation settings (the KV cache; transformers 4 kept generation defaults in
    // the model config).
    "use_cache", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    // What a forward call returns besides the logits.
    "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    // Task heads and tokenizers (a causal LM has neither labels nor a prefix).
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "task_specific_params",
    "tokenizer_class", "prefix",
    // Legacy flags Qwen3 does not read (chunked feed-forward gives the same values anyway).
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_decoder",
    // Sliding-window parameters: used only with "use_sliding_window": true, which is rejected.
    "sliding_window", "max_window_layers",
    // The attention kernel transformers picks (the same function, computed another way).
    "attn_implementation", "_attn_implementation", "_attn_implementation_autoset"};

[[noreturn]] void fail(const std::string& message) { kReader.fail(message); }

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& valid) {
  kReader.bad(key, value, valid);
}

void reject_unknown_keys(const Json& json) {
  std::string read;
  for (const auto key : kReadKeys) {
    read += (read.empty() ? "" : ", ") + std::string(key);
  }
  kReader.reject_unknown_keys(
      json, detail::qwen3_config_keys(),
      "; d9d reads " + read +
          ", and accepts the other keys transformers writes for Qwen3 (d9d/model/qwen3.hpp lists "
          "them)");
}

void expect_value(const Json& json, std::string_view key, const Json& want,
                  const std::string& why) {
  const Json* value = find(json, key);
  if (value != nullptr && *value != want) {
    bad(std::string(key), shown(*value), why);
  }
}

/// The keys that change the model: only the values d9d's Qwen3 computes with pass.
void reject_unsupported(const Json& json) {
  if (const Json* type = find(json, "model_type"); type != nullptr && *type != "qwen3") {
    bad("model_type", shown(*type),
        *type == "qwen3_moe"
            ? "this reader is the dense Qwen3's (\"qwen3\"); read Qwen3-MoE configs with "
              "d9d::model::Qwen3MoeConfig (the trainer's d9d::Qwen3MoeProvider)"
            : "d9d reads the configs of Qwen3 dense models (\"qwen3\") only");
  }
  expect_value(json, "hidden_act", "silu", "d9d's Qwen3 MLP computes SiLU (\"silu\") only");
  expect_value(json, "attention_bias", false,
               "d9d's Qwen3 attention has no bias terms (false only)");
  if (const Json* dropout = find(json, "attention_dropout");
      dropout != nullptr && (!dropout->is_number() || dropout->get<double>() != 0.0)) {
    bad("attention_dropout", shown(*dropout), "d9d implements no attention dropout (0 only)");
  }
  expect_value(json, "use_sliding_window", false,
               "d9d implements full attention only (no sliding window)");
  if (const Json* layer_types = find(json, "layer_types")) {
    if (!layer_types->is_array()) {
      bad("layer_types", shown(*layer_types), "expected a list of \"full_attention\"");
    }
    for (std::size_t i = 0; i < layer_types->size(); ++i) {
      if ((*layer_types)[i] != "full_attention") {
        bad("layer_types[" + std::to_string(i) + "]", shown((*layer_types)[i]),
            "d9d implements full attention only (\"full_attention\")");
      }
    }
  }
  if (const Json* pruned = find(json, "pruned_heads");
      pruned != nullptr && !(pruned->is_object() && pruned->empty())) {
    bad("pruned_heads", shown(*pruned), "d9d does not prune attention heads ({} only)");
  }
  for (const char* key : {"is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder"}) {
    expect_value(json, key, false, "Qwen3 is a decoder-only model (false only)");
  }
  if (const Json* size = find(json, "cross_attention_hidden_size")) {
    bad("cross_attention_hidden_size", shown(*size), "Qwen3 is a decoder-only model (null only)");
  }
  if (const Json* quantization = find(json, "quantization_config")) {
    bad("quantization_config", shown(*quantization),
        "d9d loads unquantized checkpoints only (dequantize it first)");
  }
  if (const Json* auto_map = find(json, "auto_map")) {
    bad("auto_map", shown(*auto_map),
        "custom modeling code is not supported; d9d implements transformers' own Qwen3");
  }
}

/// A positive, finite number.
double read_positive(const Json& value, const std::string& key) {
  if (!value.is_number() || !std::isfinite(value.get<double>()) || !(value.get<double>() > 0)) {
    bad(key, shown(value), "expected a finite number > 0");
  }
  return value.get<double>();
}

/// The rope theta and type, from "rope_theta" (transformers 4) and "rope_parameters"
/// (transformers 5) or "rope_scaling" (transformers 4's scaling dict). Only the default RoPE
/// passes; every theta given must agree.
std::optional<double> read_rope_theta(const Json& json) {
  std::vector<std::pair<std::string, const Json*>> thetas;
  if (const Json* theta = find(json, "rope_theta")) {
    thetas.emplace_back("rope_theta", theta);
  }
  for (const char* dict_key : {"rope_scaling", "rope_parameters"}) {
    const Json* dict = find(json, dict_key);
    if (dict == nullptr) {
      continue;
    }
    if (!dict->is_object()) {
      bad(dict_key, shown(*dict),
          "expected null or an object such as {\"rope_type\": \"default\", \"rope_theta\": "
          "1000000.0}");
    }
    const std::string prefix = std::string(dict_key) + ".";
    for (const char* type_key : {"rope_type", "type"}) {
      const Json* type = find(*dict, type_key);
      if (type != nullptr && *type != "default") {
        bad(prefix + type_key, shown(*type),
            "d9d's Qwen3 implements the default RoPE only (\"default\"); RoPE scaling such as "
            "\"linear\", \"dynamic\", \"yarn\", \"longrope\" or \"llama3\" is not supported");
      }
    }
    for (const auto& item : dict->items()) {
      if (item.key() != "rope_type" && item.key() != "type" && item.key() != "rope_theta") {
        bad(prefix + item.key(), shown(item.value()),
            "the default RoPE has no parameter but \"rope_theta\" (and \"rope_type\")");
      }
    }
    if (const Json* theta = find(*dict, "rope_theta")) {
      thetas.emplace_back(prefix + "rope_theta", theta);
    }
  }
  if (thetas.empty()) {
    return std::nullopt;
  }
  const double theta = read_positive(*thetas.front().second, thetas.front().first);
  for (std::size_t i = 1; i < thetas.size(); ++i) {
    const double other = read_positive(*thetas[i].second, thetas[i].first);
    if (other != theta) {
      fail(in_quotes(thetas.front().first) + " = " + shown(*thetas.front().second) + " and " +
           in_quotes(thetas[i].first) + " = " + shown(*thetas[i].second) +
           " disagree (transformers 4 reads the top-level \"rope_theta\", transformers 5 the one "
           "in \"rope_parameters\" or \"rope_scaling\"). Fix: give the theta once");
    }
  }
  return theta;
}

void require_keys(const Json& json, bool has_theta) {
  std::string missing;
  std::size_t count = 0;
  for (const auto key : kRequiredKeys) {
    if (find(json, key) == nullptr) {
      missing += (count++ == 0 ? "" : ", ") + in_quotes(key);
    }
  }
  if (!has_theta) {
    missing += (count++ == 0 ? "" : ", ") +
               std::string(
                   "\"rope_theta\" (at the top level as transformers 4 writes it, or in "
                   "\"rope_parameters\" as transformers 5 does)");
  }
  if (count > 0) {
    fail(std::string(count == 1 ? "missing required key " : "missing required keys ") + missing +
         "; d9d has no defaults for the model's shape");
  }
}

int64_t read_size(const Json& json, std::string_view key) {
  return kReader.read_size(*find(json, key), std::string(key));
}

void read_bool(const Json& json, std::string_view key, bool& out) {
  if (const Json* value = find(json, key)) {
    out = kReader.read_bool(*value, std::string(key));
  }
}

}  // namespace

std::vector<std::string_view> detail::qwen3_config_keys() {
  std::vector<std::string_view> keys;
  keys.insert(keys.end(), std::begin(kReadKeys), std::end(kReadKeys));
  keys.insert(keys.end(), std::begin(kCheckedKeys), std::end(kCheckedKeys));
  keys.insert(keys.end(), std::begin(kRejectedKeys), std::end(kRejectedKeys));
  keys.insert(keys.end(), std::begin(kIgnoredKeys), std::end(kIgnoredKeys));
  return keys;
}

Qwen3Config Qwen3Config::from_json_text(const std::string& text) {
  const Json json = kReader.parse_object(text);
  if (const Json* type = find(json, "model_type"); type != nullptr && *type == "qwen3_moe") {
    reject_unsupported(json);  // names the Qwen3-MoE reader before its keys look unknown
  }
  reject_unknown_keys(json);
  reject_unsupported(json);
  const auto theta = read_rope_theta(json);
  require_keys(json, theta.has_value());

  Qwen3Config config;
  config.vocab_size = read_size(json, "vocab_size");
  config.hidden_size = read_size(json, "hidden_size");
  config.intermediate_size = read_size(json, "intermediate_size");
  config.num_hidden_layers = read_size(json, "num_hidden_layers");
  config.num_attention_heads = read_size(json, "num_attention_heads");
  config.num_key_value_heads = read_size(json, "num_key_value_heads");
  config.head_dim = read_size(json, "head_dim");
  config.rms_norm_eps = read_positive(*find(json, "rms_norm_eps"), "rms_norm_eps");
  config.rope_theta = *theta;
  read_bool(json, "tie_word_embeddings", config.tie_word_embeddings);
  if (find(json, "max_position_embeddings") != nullptr) {
    config.max_position_embeddings = read_size(json, "max_position_embeddings");
  }
  if (const Json* range = find(json, "initializer_range")) {
    config.initializer_range = read_positive(*range, "initializer_range");
  }
  if (const Json* layer_types = find(json, "layer_types");
      layer_types != nullptr &&
      static_cast<int64_t>(layer_types->size()) != config.num_hidden_layers) {
    bad("layer_types", shown(*layer_types),
        "it has " + std::to_string(layer_types->size()) +
            " entries, one per layer expected "
            "(num_hidden_layers = " +
            std::to_string(config.num_hidden_layers) + ")");
  }
  config.validate();
  return config;
}

void Qwen3Config::validate() const {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"max_position_embeddings", max_position_embeddings}};
  for (const auto& [key, value] : sizes) {
    if (value < 1 || value > kMaxSize) {
      bad(key, std::to_string(value),
          "it must be an integer from 1 to " + std::to_string(kMaxSize));
    }
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    bad("num_key_value_heads", std::to_string(num_key_value_heads),
        "it must divide num_attention_heads = " + std::to_string(num_attention_heads));
  }
  if (head_dim % 2 != 0) {
    bad("head_dim", std::to_string(head_dim), "rotary embeddings need an even head_dim");
  }
  const std::pair<const char*, double> positives[] = {{"rms_norm_eps", rms_norm_eps},
                                                      {"rope_theta", rope_theta},
                                                      {"initializer_range", initializer_range}};
  for (const auto& [key, value] : positives) {
    if (!(value > 0) || !std::isfinite(value)) {
      bad(key, std::to_string(value), "it must be a finite number > 0");
    }
  }
}

std::string Qwen3Config::to_hf_json(const std::string& torch_dtype) const {
  // The rope theta at the top level with "rope_scaling": null: transformers 4 reads it there, and
  // transformers 5 moves it into its "rope_parameters" when it loads the file.
  const nlohmann::ordered_json json = {{"architectures", {"Qwen3ForCausalLM"}},
                                       {"model_type", "qwen3"},
                                       {"dtype", torch_dtype},
                                       {"vocab_size", vocab_size},
                                       {"hidden_size", hidden_size},
                                       {"intermediate_size", intermediate_size},
                                       {"num_hidden_layers", num_hidden_layers},
                                       {"num_attention_heads", num_attention_heads},
                                       {"num_key_value_heads", num_key_value_heads},
                                       {"head_dim", head_dim},
                                       {"hidden_act", "silu"},
                                       {"rms_norm_eps", rms_norm_eps},
                                       {"rope_theta", rope_theta},
                                       {"rope_scaling", nullptr},
                                       {"attention_bias", false},
                                       {"attention_dropout", 0.0},
                                       {"tie_word_embeddings", tie_word_embeddings},
                                       {"max_position_embeddings", max_position_embeddings},
                                       {"initializer_range", initializer_range},
                                       {"use_sliding_window", false},
                                       {"sliding_window", nullptr},
                                       {"use_cache", true}};
  return json.dump(2) + "\n";
}

int64_t Qwen3Config::non_embedding_parameter_count() const {
  const int64_t attention = hidden_size * num_attention_heads * head_dim +
                            2 * hidden_size * num_key_value_heads * head_dim +
                            num_attention_heads * head_dim * hidden_size + 2 * head_dim;
  const int64_t mlp = 3 * hidden_size * intermediate_size;
  return num_hidden_layers * (attention + mlp + 2 * hidden_size) + hidden_size;
}

int64_t Qwen3Config::parameter_count() const {
  return non_embedding_parameter_count() + vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
}

VirtualLayers detail::qwen3_virtual_layers(const Qwen3Config& config, double mean_layer_parameters,
                                           int64_t sequence_length) {
  if (sequence_length < 0) {
    throw std::invalid_argument("d9d::model::pipeline_virtual_layers: sequence_length = " +
                                std::to_string(sequence_length) + " must be >= 0");
  }
  // Forward FLOPs per token: 2 per matmul parameter; causal attention multiplies each query by
  // T / 2 keys on average, twice (scores and values), 2 FLOPs each.
  const double attention = 2.0 * static_cast<double>(sequence_length) *
                           static_cast<double>(config.num_attention_heads * config.head_dim);
  const double layer = 2.0 * mean_layer_parameters + attention;
  const double head = 2.0 * static_cast<double>(config.hidden_size * config.vocab_size);
  return {.embedding = 0.5, .head = layer > 0 ? head / layer : 0.0};
}

VirtualLayers pipeline_virtual_layers(const Qwen3Config& config, int64_t sequence_length) {
  const int64_t layers = std::max<int64_t>(config.num_hidden_layers, 1);
  // Without the final norm; the layers' norms are counted too (a rounding error).
  const auto per_layer =
      static_cast<double>(config.non_embedding_parameter_count() - config.hidden_size) /
      static_cast<double>(layers);
  return detail::qwen3_virtual_layers(config, per_layer, sequence_length);
}

}  // namespace d9d::model
