// d9d/model/qwen3_moe.cpp — the Qwen3-MoE model and its pipeline stages (the config:
// qwen3_moe_config.cpp; the MoE block: moe.cpp).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <ATen/ATen.h>

#include <d9d/model/detail/decoder_stage.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/model/qwen3_moe.hpp>

namespace d9d::model {
namespace {
constexpr std::string_view kStageWho = "d9d::model::Qwen3MoeStage";
}  // namespace

Qwen3MoeDecoderLayerImpl::Qwen3MoeDecoderLayerImpl(const Qwen3MoeConfig& config,
                                                   int64_t layer_index) {
  declare_part(Part::attention);
  detail::register_attention(*this, config, input_layernorm, self_attn, post_attention_layernorm);
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
    const auto h = in + run_part(Part::attention, in, [this, cos_sin](const at::Tensor& t) {
                     return self_attn(input_layernorm(t), cos_sin);
                   });
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
  const auto cos_sin = detail::rope_tables(rope_, input_ids, h);
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
  auto stats =
      std::make_shared<MoeForwardStats>(config_.aux_loss_coef(), config_.router_aux_loss_type);
  const auto hidden = model(input_ids, stats);
  stats->finish();
  last_stats_ = stats;
  return detail::tied_head(hidden, lm_head, model->embed_tokens);
}

CausalLmLoss Qwen3MoeForCausalLMImpl::loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                           int64_t ignore_index) {
  if (!fused_kernels()) {
    return causal_lm_loss(forward(input_ids), labels, ignore_index);
  }
  auto stats =
      std::make_shared<MoeForwardStats>(config_.aux_loss_coef(), config_.router_aux_loss_type);
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
                                     LayerRange layers)
    : config_(config), stage_(stage), stages_(stages), rope_(config.head_dim, config.rope_theta) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  detail::check_stage(kStageWho, stage, stages, layers, config_.num_hidden_layers);
  auto parts = detail::register_stage_modules(
      *this, config_, {.first = is_first(), .last = is_last()}, layers,
      [this](int i) { return Qwen3MoeDecoderLayer(config_, i); });
  embed_tokens = parts.embed_tokens;
  this->layers = std::move(parts.layers);
  norm = parts.norm;
  lm_head = parts.lm_head;
  int64_t mine = 0;
  int64_t all = 0;
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const bool sparse = config_.is_moe_layer(i);
    all += sparse ? 1 : 0;
    mine += sparse && i >= layers.begin && i < layers.end ? 1 : 0;
  }
  moe_share_ = all > 0 ? static_cast<double>(mine) / static_cast<double>(all) : 1.0;
  init_qwen3_parameters(*this, config_, seed);
}

at::Tensor Qwen3MoeStageImpl::forward(const at::Tensor& input) {
  detail::check_stage_input(kStageWho, stage_, is_first(), input, config_.hidden_size);
  at::Tensor h = is_first() ? embed_tokens(input) : input;
  if (!layers.empty()) {
    auto stats = std::make_shared<MoeForwardStats>(config_.aux_loss_coef() * moe_share_,
                                                   config_.router_aux_loss_type);
    const auto cos_sin = detail::rope_tables(rope_, h, h);
    for (auto& layer : layers) {
      h = layer(h, cos_sin, stats);
    }
    stats->finish();
  }
  if (!is_last()) {
    return h;
  }
  return detail::tied_head(norm(h), lm_head, embed_tokens);
}

std::vector<int64_t> Qwen3MoeStageImpl::input_sizes(int64_t batch, int64_t seq) const {
  return detail::stage_input_sizes(is_first(), batch, seq, config_.hidden_size);
}

std::vector<int64_t> Qwen3MoeStageImpl::output_sizes(int64_t batch, int64_t seq) const {
  return detail::stage_output_sizes(is_last(), batch, seq, config_.hidden_size, config_.vocab_size);
}

}  // namespace d9d::model
