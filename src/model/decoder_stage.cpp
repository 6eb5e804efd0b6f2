// d9d/model/decoder_stage.cpp — what the dense and MoE Qwen3 models share
// (d9d/model/detail/decoder_stage.hpp).
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <d9d/model/detail/decoder_stage.hpp>

namespace d9d::model::detail {

void register_attention(torch::nn::Module& layer, const Qwen3Config& config,
                        RmsNorm& input_layernorm, Attention& self_attn,
                        RmsNorm& post_attention_layernorm) {
  input_layernorm =
      layer.register_module("input_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  self_attn = layer.register_module("self_attn", Attention(AttentionOptions{
                                                     .hidden_size = config.hidden_size,
                                                     .num_heads = config.num_attention_heads,
                                                     .num_kv_heads = config.num_key_value_heads,
                                                     .head_dim = config.head_dim,
                                                     .rms_norm_eps = config.rms_norm_eps,
                                                 }));
  post_attention_layernorm = layer.register_module(
      "post_attention_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
}

std::pair<at::Tensor, at::Tensor> rope_tables(const RotaryEmbedding& rope, const at::Tensor& tokens,
                                              const at::Tensor& h) {
  return rope.cos_sin(tokens.size(1), tokens.device(),
                      RotaryEmbedding::table_dtype(h.scalar_type()));
}

TokenPlacement context_placement(const RotaryEmbedding& rope, int64_t batch, int64_t tokens,
                                 c10::Device device, at::ScalarType dtype,
                                 const ContextParallelGroup& group) {
  check_context_length(tokens, group.size());
  const auto [cos, sin] = rope.cos_sin(tokens, device, dtype);
  TokenPlacement out;
  out.cos = context_shard(cos, 0, group.rank(), group.size()).repeat({batch, 1});
  out.sin = context_shard(sin, 0, group.rank(), group.size()).repeat({batch, 1});
  return out;
}

void check_stage(std::string_view who, int stage, int stages, LayerRange layers,
                 int64_t num_hidden_layers) {
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument(std::string(who) + ": stage " + std::to_string(stage) +
                                " is not one of " + std::to_string(stages) + " stages");
  }
  if (layers.begin < 0 || layers.end < layers.begin || layers.end > num_hidden_layers) {
    throw std::invalid_argument(std::string(who) + ": layers [" + std::to_string(layers.begin) +
                                ", " + std::to_string(layers.end) + ") are not within the " +
                                std::to_string(num_hidden_layers) + " decoder layers");
  }
}

void check_stage_input(std::string_view who, int stage, bool first, const at::Tensor& input,
                       int64_t hidden_size) {
  if (first) {
    if (input.dim() != 2 || input.is_floating_point()) {
      throw std::invalid_argument(std::string(who) +
                                  ": the first stage takes token ids [batch, seq] (int64)");
    }
  } else if (input.dim() != 3 || input.size(2) != hidden_size) {
    throw std::invalid_argument(std::string(who) + ": stage " + std::to_string(stage) +
                                " takes hidden states [batch, seq, " + std::to_string(hidden_size) +
                                "]");
  }
}

std::vector<int64_t> stage_input_sizes(bool first, int64_t batch, int64_t seq,
                                       int64_t hidden_size) {
  if (first) {
    return {batch, seq};
  }
  return {batch, seq, hidden_size};
}

std::vector<int64_t> stage_output_sizes(bool last, int64_t batch, int64_t seq, int64_t hidden_size,
                                        int64_t vocab_size) {
  return {batch, seq, last ? vocab_size : hidden_size};
}

at::Tensor tied_head(const at::Tensor& h, Linear& lm_head,
                     const torch::nn::Embedding& embed_tokens) {
  if (lm_head) {
    return lm_head(h);
  }
  return at::linear(h, embed_tokens->weight.to(h.scalar_type()));
}

}  // namespace d9d::model::detail
