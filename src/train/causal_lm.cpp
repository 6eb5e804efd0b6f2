// d9d/train/causal_lm.cpp — Qwen3 provider, token-file dataset provider, causal-LM task.
#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/data/token_dataset.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/config.hpp>

namespace d9d {

namespace {

// The "model" section read by a Qwen3-family config reader (Qwen3Config, Qwen3MoeConfig), its
// errors as the trainer's ConfigError.
template <class Config>
Config read_model_config(const std::string& json) {
  try {
    return Config::from_json_text(json);
  } catch (const std::invalid_argument& error) {
    throw ConfigError(std::string(error.what()) + " (in the \"model\" section)");
  }
}

// The whole model of a Qwen3-family config, on the context's device.
template <class Model, class Config>
Model build_model_of(const Config& config, const ModelBuildContext& context) {
  Model model(config);
  model->to(context.device);
  return model;
}

// A pipeline stage of a Qwen3-family model (dense or MoE): the layers distributed over the stages
// with the embedding and the head weighed by their FLOPs at the run's sequence length
// (d9d::model::pipeline_virtual_layers), on the context's device. A tied head on
// a last stage other than the first holds a copy of the embedding (d9d/model/qwen3_stage.hpp).
template <class Stage, class Config>
Stage build_stage_of(const Config& config, const StageBuildContext& context) {
  const auto ranges =
      model::distribute_layers(static_cast<int>(config.num_hidden_layers), context.stages,
                               model::pipeline_virtual_layers(config, context.sequence_length));
  Stage stage(config, context.stage, context.stages,
              ranges[static_cast<std::size_t>(context.stage)]);
  stage->to(context.device);
  return stage;
}

}  // namespace

model::Qwen3ForCausalLM Qwen3Provider::build(const ModelBuildContext& context) {
  config_ = read_model_config<model::Qwen3Config>(context.config_json);
  return build_model_of<model::Qwen3ForCausalLM>(config_, context);
}

model::Qwen3Stage Qwen3Provider::build_stage(const StageBuildContext& context) {
  config_ = read_model_config<model::Qwen3Config>(context.config_json);
  return build_stage_of<model::Qwen3Stage>(config_, context);
}

std::string Qwen3Provider::hf_config_json() const { return config_.to_hf_json("float32"); }

state::Mapper Qwen3Provider::hf_load_mapper(const std::vector<std::string>& source_keys,
                                            const std::vector<std::string>& names) const {
  const auto has = [](const std::vector<std::string>& keys, const std::string& key) {
    return std::find(keys.begin(), keys.end(), key) != keys.end();
  };
  if (config_.tie_word_embeddings && has(source_keys, "lm_head.weight") &&
      !has(names, "lm_head.weight")) {
    // Some tied checkpoints store the shared weight twice.
    return state::parallel({state::identity(names), state::drop({"lm_head.weight"})});
  }
  return state::identity(names);
}

model::Qwen3MoeForCausalLM Qwen3MoeProvider::build(const ModelBuildContext& context) {
  config_ = read_model_config<model::Qwen3MoeConfig>(context.config_json);
  return build_model_of<model::Qwen3MoeForCausalLM>(config_, context);
}

model::Qwen3MoeStage Qwen3MoeProvider::build_stage(const StageBuildContext& context) {
  config_ = read_model_config<model::Qwen3MoeConfig>(context.config_json);
  return build_stage_of<model::Qwen3MoeStage>(config_, context);
}

std::string Qwen3MoeProvider::hf_config_json() const { return config_.to_hf_json("float32"); }

state::Mapper Qwen3MoeProvider::hf_export_mapper(const std::vector<std::string>& names) const {
  return model::qwen3_moe_hf_export_mapper(config_, names);
}

state::Mapper Qwen3MoeProvider::hf_load_mapper(const std::vector<std::string>& source_keys,
                                               const std::vector<std::string>& names) const {
  return model::qwen3_moe_hf_load_mapper(config_, source_keys, names);
}

struct TokenWindows::State {
  data::TokenDataset dataset;
};

TokenWindows::TokenWindows(std::vector<std::string> paths, const std::string& token_width,
                           int64_t sequence_length, int64_t vocab_size) {
  const auto width = token_width == "u32" ? data::TokenWidth::u32 : data::TokenWidth::u16;
  state_ = std::make_shared<const State>(
      State{data::TokenDataset::open(std::move(paths), width, sequence_length)});
  if (vocab_size > 0) {
    state_->dataset.check_vocab(vocab_size);
  }
}

int64_t TokenWindows::size() const { return state_->dataset.size(); }

CausalLmBatch TokenWindows::get(const std::vector<int64_t>& indices) const {
  return {.tokens = state_->dataset.batch(indices)};
}

int64_t TokenWindows::vocab_bound() const { return state_->dataset.vocab_bound(); }

TokenWindows TokenFilesProvider::build(const DataBuildContext& context) {
  nlohmann::json json = nlohmann::json::parse(context.config_json);
  const auto fail = [](const std::string& key, const std::string& value, const std::string& what) {
    throw ConfigError("d9d config: \"data." + key + "\" = " + value + " is invalid: " + what);
  };
  for (const auto& item : json.items()) {
    if (item.key() != "paths" && item.key() != "token_width") {
      throw ConfigError("d9d config: unknown key \"data." + item.key() +
                        "\"; valid keys in \"data\": paths, token_width");
    }
  }
  if (!json.contains("paths")) {
    throw ConfigError("d9d config: \"data.paths\" is required (a list of token files)");
  }
  const auto& paths_json = json.at("paths");
  if (!paths_json.is_array() || paths_json.empty()) {
    fail("paths", paths_json.dump(), "expected a non-empty list of file paths");
  }
  std::vector<std::string> paths;
  for (const auto& path : paths_json) {
    if (!path.is_string()) {
      fail("paths", paths_json.dump(), "expected a list of strings");
    }
    paths.push_back(path.get<std::string>());
  }
  std::string width = "u16";
  if (json.contains("token_width")) {
    const auto& value = json.at("token_width");
    if (!value.is_string() || (value != "u16" && value != "u32")) {
      fail("token_width", value.dump(), "expected \"u16\" or \"u32\"");
    }
    width = value.get<std::string>();
  }
  if (context.sequence_length < 1) {
    throw ConfigError(
        "d9d config: \"batch.sequence_length\" is not given, but d9d::TokenFilesProvider cuts the "
        "token files into windows of that many tokens. Fix: set \"batch\": {\"sequence_length\": "
        "N, ...}");
  }
  // The model's vocabulary, when its section gives one: ids beyond it are caught here, not as an
  // index error (or a device-side assert on a GPU) in the middle of training.
  int64_t vocab_size = 0;
  const auto model = nlohmann::json::parse(context.model_config_json, nullptr, false);
  if (model.is_object() && model.contains("vocab_size") &&
      model.at("vocab_size").is_number_integer()) {
    vocab_size = model.at("vocab_size").get<int64_t>();
  }
  try {
    return {std::move(paths), width, context.sequence_length, vocab_size};
  } catch (const std::exception& error) {
    throw ConfigError(std::string("d9d config: \"data.paths\": ") + error.what());
  }
}

LossOutput CausalLmTask::compute_loss(model::Qwen3ForCausalLM& model, const CausalLmBatch& batch) {
  const auto& device = model->model->embed_tokens->weight.device();
  const auto tokens = batch.tokens.to(device);
  const int64_t length = tokens.size(1) - 1;
  const auto inputs = tokens.narrow(1, 0, length);
  auto labels = tokens.narrow(1, 1, length);
  if (options_.document_separator < 0) {
    const auto loss = model->loss(inputs, labels);
    return {.loss_sum = loss.loss_sum, .weight = loss.tokens};
  }
  // A document ends with its separator: the tokens after one belong to the next document.
  const auto separator = inputs.eq(options_.document_separator);
  const auto documents = separator.cumsum(1) - separator.to(at::kLong);
  const auto where = model::place_documents(
      model->model->rope(), documents,
      model::RotaryEmbedding::table_dtype(model->model->embed_tokens->weight.scalar_type()));
  labels = labels.masked_fill(separator, -100);
  const auto loss = model->loss(inputs, labels, -100, &where);
  return {.loss_sum = loss.loss_sum, .weight = loss.tokens};
}

LossOutput CausalLmTask::compute_loss(model::Qwen3MoeForCausalLM& model,
                                      const CausalLmBatch& batch) {
  if (options_.document_separator >= 0) {
    throw std::invalid_argument(
        "d9d::CausalLmTask: document_separator (documents kept apart) is built for dense Qwen3 "
        "only, not Qwen3-MoE. Fix: leave CausalLmOptions::document_separator at -1");
  }
  const auto& device = model->model->embed_tokens->weight.device();
  const auto tokens = batch.tokens.to(device);
  const int64_t length = tokens.size(1) - 1;
  const auto loss = model->loss(tokens.narrow(1, 0, length), tokens.narrow(1, 1, length));
  return {.loss_sum = loss.loss_sum, .weight = loss.tokens};
}

at::Tensor CausalLmTask::stage_input(const CausalLmBatch& batch) {
  if (options_.document_separator >= 0) {
    throw std::invalid_argument(
        "d9d::CausalLmTask: document_separator (documents kept apart) does not pass through "
        "pipeline stages yet. Fix: leave CausalLmOptions::document_separator at -1 with a "
        "pipeline plan");
  }
  return batch.tokens.narrow(1, 0, batch.tokens.size(1) - 1);
}

LossOutput CausalLmTask::output_loss(const at::Tensor& logits, const CausalLmBatch& batch) {
  return output_loss(logits, batch, SequencePart{});
}

LossOutput CausalLmTask::output_loss(const at::Tensor& logits, const CausalLmBatch& batch,
                                     const SequencePart& part) {
  return output_loss(logits, batch, part, VocabPart{});
}

LossOutput CausalLmTask::output_loss(const at::Tensor& logits, const CausalLmBatch& batch,
                                     const SequencePart& part, const VocabPart& vocab) {
  const auto labels =
      part(batch.tokens.narrow(1, 1, batch.tokens.size(1) - 1), 1).to(logits.device());
  if (vocab.whole()) {
    const auto loss = model::fused_kernels() ? model::logits_cross_entropy(logits, labels)
                                             : model::causal_lm_loss(logits, labels);
    return {.loss_sum = loss.loss_sum, .weight = loss.tokens};
  }
  const auto flat_labels = labels.reshape({-1});
  return {
      .loss_sum = vocab.cross_entropy_sum(logits.reshape({-1, logits.size(-1)}), flat_labels, -100),
      .weight = (flat_labels != -100).sum()};
}

at::Tensor VocabPart::cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels,
                                        int64_t ignore_index) const {
  if (whole()) {
    return (model::fused_kernels() ? model::logits_cross_entropy(logits, labels, ignore_index)
                                   : model::causal_lm_loss(logits, labels, ignore_index))
        .loss_sum;
  }
  return slice.group->cross_entropy_sum(logits, labels, slice.start, ignore_index);
}

}  // namespace d9d
