// d9d/model/qwen3.cpp — the Qwen3 dense model, its config and the causal-LM loss.
#include <cstdint>
#include <mutex>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <d9d/model/qwen3.hpp>

namespace d9d::model {
namespace {

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& valid) {
  throw std::invalid_argument("d9d Qwen3 config: \"" + key + "\" = " + value + " is invalid; " +
                              valid);
}

template <class T>
void read(const nlohmann::json& json, const char* key, T& out) {
  if (!json.contains(key) || json.at(key).is_null()) {
    return;
  }
  const auto& value = json.at(key);
  if constexpr (std::is_same_v<T, bool>) {
    if (!value.is_boolean()) {
      bad(key, value.dump(), "expected true or false");
    }
  } else if constexpr (std::is_integral_v<T>) {
    if (!value.is_number_integer()) {
      bad(key, value.dump(), "expected an integer");
    }
  } else {
    if (!value.is_number()) {
      bad(key, value.dump(), "expected a number");
    }
  }
  out = value.get<T>();
}

}  // namespace

Qwen3Config Qwen3Config::from_json_text(const std::string& text) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& error) {
    throw std::invalid_argument(std::string("d9d Qwen3 config: not valid JSON: ") + error.what());
  }
  if (!json.is_object()) {
    throw std::invalid_argument("d9d Qwen3 config: expected a JSON object");
  }
  Qwen3Config config;
  read(json, "vocab_size", config.vocab_size);
  read(json, "hidden_size", config.hidden_size);
  read(json, "intermediate_size", config.intermediate_size);
  read(json, "num_hidden_layers", config.num_hidden_layers);
  read(json, "num_attention_heads", config.num_attention_heads);
  read(json, "num_key_value_heads", config.num_key_value_heads);
  read(json, "head_dim", config.head_dim);
  read(json, "rms_norm_eps", config.rms_norm_eps);
  read(json, "rope_theta", config.rope_theta);
  read(json, "tie_word_embeddings", config.tie_word_embeddings);
  read(json, "max_position_embeddings", config.max_position_embeddings);
  read(json, "initializer_range", config.initializer_range);
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
    if (value < 1) {
      bad(key, std::to_string(value), "it must be a positive integer");
    }
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    bad("num_key_value_heads", std::to_string(num_key_value_heads),
        "it must divide num_attention_heads = " + std::to_string(num_attention_heads));
  }
  if (head_dim % 2 != 0) {
    bad("head_dim", std::to_string(head_dim), "rotary embeddings need an even head_dim");
  }
  if (!(rms_norm_eps > 0)) {
    bad("rms_norm_eps", std::to_string(rms_norm_eps), "it must be > 0");
  }
  if (!(rope_theta > 0)) {
    bad("rope_theta", std::to_string(rope_theta), "it must be > 0");
  }
  if (!(initializer_range > 0)) {
    bad("initializer_range", std::to_string(initializer_range), "it must be > 0");
  }
}

std::string Qwen3Config::to_hf_json(const std::string& torch_dtype) const {
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

Qwen3DecoderLayerImpl::Qwen3DecoderLayerImpl(const Qwen3Config& config) {
  input_layernorm =
      register_module("input_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  self_attn = register_module("self_attn", Attention(AttentionOptions{
                                               .hidden_size = config.hidden_size,
                                               .num_heads = config.num_attention_heads,
                                               .num_kv_heads = config.num_key_value_heads,
                                               .head_dim = config.head_dim,
                                               .rms_norm_eps = config.rms_norm_eps,
                                           }));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  mlp = register_module("mlp", SwiGlu(config.hidden_size, config.intermediate_size));
}

at::Tensor Qwen3DecoderLayerImpl::forward(const at::Tensor& x,
                                          const std::pair<at::Tensor, at::Tensor>& cos_sin) {
  return run_block(x, [this, cos_sin](const at::Tensor& in) {
    const auto h = in + self_attn(input_layernorm(in), cos_sin);
    return h + mlp(post_attention_layernorm(h));
  });
}

Qwen3ModelImpl::Qwen3ModelImpl(const Qwen3Config& config)
    : rope_(config.head_dim, config.rope_theta) {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(Qwen3DecoderLayer(config));
  }
  norm = register_module("norm", RmsNorm(config.hidden_size, config.rms_norm_eps));
}

at::Tensor Qwen3ModelImpl::forward(const at::Tensor& input_ids) {
  auto h = embed_tokens(input_ids);
  const auto cos_sin = rope_.cos_sin(input_ids.size(1), input_ids.device());
  for (const auto& layer : *layers) {
    h = layer->as<Qwen3DecoderLayer>()->forward(h, cos_sin);
  }
  return norm(h);
}

uint64_t draw_init_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

void init_qwen3_parameters(torch::nn::Module& module, const Qwen3Config& config, uint64_t seed) {
  const at::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    const auto& name = item.key();
    auto& param = item.value();
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0) {
      param.fill_(1.0);
      continue;
    }
    // FNV-1a of the name, mixed with the base draw: a stable seed per parameter.
    uint64_t hash = 14695981039346656037ULL ^ seed;
    for (const char c : name) {
      hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(hash);
    const auto values = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat))
                            .normal_(0.0, config.initializer_range, generator);
    param.copy_(values);
  }
}

Qwen3ForCausalLMImpl::Qwen3ForCausalLMImpl(Qwen3Config config) : config_(config) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  model = register_module("model", Qwen3Model(config_));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  init_qwen3_parameters(*this, config_, seed);
}

at::Tensor Qwen3ForCausalLMImpl::forward(const at::Tensor& input_ids) {
  const auto hidden = model(input_ids);
  if (lm_head) {
    return lm_head(hidden);
  }
  return at::linear(hidden, model->embed_tokens->weight.to(hidden.scalar_type()));
}

CausalLmLoss causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t ignore_index) {
  const int64_t vocab = logits.size(-1);
  // At least float32 (bf16 logits are upcast; float64 stays float64).
  const auto flat_logits =
      logits.reshape({-1, vocab}).to(at::promote_types(logits.scalar_type(), at::kFloat));
  const auto flat_labels = labels.reshape({-1});
  auto loss_sum = at::cross_entropy_loss(flat_logits, flat_labels, /*weight=*/{},
                                         at::Reduction::Sum, ignore_index);
  auto tokens = (flat_labels != ignore_index).sum();
  return {.loss_sum = std::move(loss_sum), .tokens = std::move(tokens)};
}

}  // namespace d9d::model
