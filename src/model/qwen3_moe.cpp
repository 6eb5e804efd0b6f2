// d9d/model/qwen3_moe.cpp — the Qwen3-MoE model and its pipeline stages (the config:
// qwen3_moe_config.cpp; the MoE block: moe.cpp).
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/model/qwen3_moe.hpp>

namespace d9d::model {

Qwen3MoeDecoderLayerImpl::Qwen3MoeDecoderLayerImpl(const Qwen3MoeConfig& config,
                                                   int64_t layer_index) {
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
  if (config.is_moe_layer(layer_index)) {
    moe = register_module("mlp", MoeLayer(config.moe_options(), layer_index));
  } else {
    mlp = register_module("mlp", SwiGlu(config.hidden_size, config.intermediate_size));
  }
}

at::Tensor Qwen3MoeDecoderLayerImpl::forward(const at::Tensor& x,
                                             const std::pair<at::Tensor, at::Tensor>& cos_sin,
                                             const std::shared_ptr<MoeForwardStats>& stats) {
  // Captures by value: recompute runs the body again in backward, with the same stats object.
  return run_block(x, [this, cos_sin, stats](const at::Tensor& in) {
    const auto h = in + self_attn(input_layernorm(in), cos_sin);
    const auto normed = post_attention_layernorm(h);
    return h + (moe ? moe(normed, stats) : mlp(normed));
  });
}

Qwen3MoeModelImpl::Qwen3MoeModelImpl(const Qwen3MoeConfig& config)
    : rope_(config.head_dim, config.rope_theta) {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(Qwen3MoeDecoderLayer(config, i));
  }
  norm = register_module("norm", RmsNorm(config.hidden_size, config.rms_norm_eps));
}

at::Tensor Qwen3MoeModelImpl::forward(const at::Tensor& input_ids,
                                      const std::shared_ptr<MoeForwardStats>& stats) {
  auto h = embed_tokens(input_ids);
  const auto cos_sin = rope_.cos_sin(input_ids.size(1), input_ids.device(),
                                     RotaryEmbedding::table_dtype(h.scalar_type()));
  for (const auto& layer : *layers) {
    h = layer->as<Qwen3MoeDecoderLayer>()->forward(h, cos_sin, stats);
  }
  return norm(h);
}

Qwen3MoeForCausalLMImpl::Qwen3MoeForCausalLMImpl(Qwen3MoeConfig config)
    : config_(std::move(config)) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  model = register_module("model", Qwen3MoeModel(config_));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  init_qwen3_parameters(*this, config_, seed);
}

at::Tensor Qwen3MoeForCausalLMImpl::forward(const at::Tensor& input_ids) {
  auto stats = std::make_shared<MoeForwardStats>(config_.aux_loss_coef());
  const auto hidden = model(input_ids, stats);
  stats->finish();
  last_stats_ = stats;
  if (lm_head) {
    return lm_head(hidden);
  }
  return at::linear(hidden, model->embed_tokens->weight.to(hidden.scalar_type()));
}

CausalLmLoss Qwen3MoeForCausalLMImpl::loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                           int64_t ignore_index) {
  if (!fused_kernels()) {
    return causal_lm_loss(forward(input_ids), labels, ignore_index);
  }
  auto stats = std::make_shared<MoeForwardStats>(config_.aux_loss_coef());
  const auto hidden = model(input_ids, stats);
  stats->finish();
  last_stats_ = stats;
  const auto& head = lm_head ? lm_head->weight : model->embed_tokens->weight;
  return linear_cross_entropy(hidden.reshape({-1, hidden.size(-1)}), head, labels.reshape({-1}),
                              ignore_index);
}

double Qwen3MoeForCausalLMImpl::last_aux_loss() const {
  return last_stats_ ? last_stats_->aux_loss() : 0.0;
}

// ---- stages ------------------------------------------------------------------------------------

Qwen3MoeStageImpl::Qwen3MoeStageImpl(const Qwen3MoeConfig& config, int stage, int stages,
                                     pipeline::LayerRange layers)
    : config_(config), stage_(stage), stages_(stages), rope_(config.head_dim, config.rope_theta) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("d9d::model::Qwen3MoeStage: stage " + std::to_string(stage) +
                                " is not one of " + std::to_string(stages) + " stages");
  }
  if (layers.begin < 0 || layers.end < layers.begin || layers.end > config_.num_hidden_layers) {
    throw std::invalid_argument("d9d::model::Qwen3MoeStage: layers [" +
                                std::to_string(layers.begin) + ", " + std::to_string(layers.end) +
                                ") are not within the " +
                                std::to_string(config_.num_hidden_layers) + " decoder layers");
  }
  auto body = std::make_shared<torch::nn::Module>();
  // A tied LM head on a last stage that is not the first holds its own copy of the embedding,
  // under the embedding's name: it starts with the same values (initialised by name), the
  // parallelize layer sums the two holders' gradients (d9d::parallel::detail::tie_stage_parameters)
  // and checkpoints, export and init_from see one "model.embed_tokens.weight".
  if (is_first() || (is_last() && config_.tie_word_embeddings)) {
    embed_tokens = body->register_module(
        "embed_tokens", torch::nn::Embedding(config_.vocab_size, config_.hidden_size));
  }
  auto layer_list = std::make_shared<torch::nn::Module>();
  for (int i = layers.begin; i < layers.end; ++i) {
    this->layers.emplace_back(
        layer_list->register_module(std::to_string(i), Qwen3MoeDecoderLayer(config_, i)));
  }
  body->register_module("layers", layer_list);
  if (is_last()) {
    norm = body->register_module("norm", RmsNorm(config_.hidden_size, config_.rms_norm_eps));
  }
  register_module("model", body);
  if (is_last() && !config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  init_qwen3_parameters(*this, config_, seed);
}

at::Tensor Qwen3MoeStageImpl::forward(const at::Tensor& input) {
  at::Tensor h;
  if (is_first()) {
    if (input.dim() != 2 || input.is_floating_point()) {
      throw std::invalid_argument(
          "d9d::model::Qwen3MoeStage: the first stage takes token ids [batch, seq] (int64)");
    }
    h = embed_tokens(input);
  } else {
    if (input.dim() != 3 || input.size(2) != config_.hidden_size) {
      throw std::invalid_argument("d9d::model::Qwen3MoeStage: stage " + std::to_string(stage_) +
                                  " takes hidden states [batch, seq, " +
                                  std::to_string(config_.hidden_size) + "]");
    }
    h = input;
  }
  if (!layers.empty()) {
    auto stats = std::make_shared<MoeForwardStats>(config_.aux_loss_coef());
    const auto cos_sin =
        rope_.cos_sin(h.size(1), h.device(), RotaryEmbedding::table_dtype(h.scalar_type()));
    for (auto& layer : layers) {
      h = layer(h, cos_sin, stats);
    }
    stats->finish();
  }
  if (!is_last()) {
    return h;
  }
  h = norm(h);
  if (lm_head) {
    return lm_head(h);
  }
  return at::linear(h, embed_tokens->weight.to(h.scalar_type()));
}

std::vector<int64_t> Qwen3MoeStageImpl::input_sizes(int64_t batch, int64_t seq) const {
  if (is_first()) {
    return {batch, seq};
  }
  return {batch, seq, config_.hidden_size};
}

std::vector<int64_t> Qwen3MoeStageImpl::output_sizes(int64_t batch, int64_t seq) const {
  return {batch, seq, is_last() ? config_.vocab_size : config_.hidden_size};
}

}  // namespace d9d::model
