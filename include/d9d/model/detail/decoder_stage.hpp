// d9d/model/detail/decoder_stage.hpp — what the Qwen3-family models share between their dense and
// MoE forms (not a public API): the attention half of a decoder layer, and a pipeline stage's
// modules, checks, rotary tables and head.
//
//   detail::register_attention(*this, config, input_layernorm, self_attn,
//   post_attention_layernorm); auto parts = detail::register_stage_modules(*this, config, {.first =
//   true, .last = false},
//                                               layers, [&](int) { return
//                                               Qwen3DecoderLayer(config); });
//
// The stage models (d9d/model/qwen3_stage.hpp, d9d/model/qwen3_moe.hpp) differ in their decoder
// layer (its MLP: dense SwiGLU or MoE block) and in what the MoE stage pools (routing statistics);
// everything else goes through these functions, so both stages keep the whole model's parameter
// names and the same messages (each naming its own class, `who`).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include <d9d/model/context_parallel.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/stage_layers.hpp>

namespace d9d::model::detail {

/// Registers the attention half of a Qwen3 decoder layer on `layer`, in Qwen3's order:
/// "input_layernorm", "self_attn", "post_attention_layernorm" (the caller registers "mlp" next).
void register_attention(torch::nn::Module& layer, const Qwen3Config& config,
                        RmsNorm& input_layernorm, Attention& self_attn,
                        RmsNorm& post_attention_layernorm);

/// The rotary tables (cos, sin) for `tokens` [B, T, ...] (T positions, on its device) in the
/// dtype the layers use for hidden states `h`.
[[nodiscard]] std::pair<at::Tensor, at::Tensor> rope_tables(const RotaryEmbedding& rope,
                                                            const at::Tensor& tokens,
                                                            const at::Tensor& h);

/// Under context parallelism: the placement of this rank's tokens of `batch` sequences of
/// `tokens` positions each (the rotary tables of its two chunks, d9d::model::context_shard;
/// causal), tables in `dtype` on `device`.
[[nodiscard]] TokenPlacement context_placement(const RotaryEmbedding& rope, int64_t batch,
                                               int64_t tokens, c10::Device device,
                                               at::ScalarType dtype,
                                               const ContextParallelGroup& group);

/// Where a stage sits in the pipeline.
struct StagePosition {
  bool first = false;
  bool last = false;
};

/// std::invalid_argument "<who>: stage s is not one of n stages", or "<who>: layers [b, e) are not
/// within the N decoder layers".
void check_stage(std::string_view who, int stage, int stages, LayerRange layers,
                 int64_t num_hidden_layers);

/// std::invalid_argument unless `input` is what stage `stage` takes: token ids [batch, seq]
/// (int64) on the first stage, hidden states [batch, seq, hidden_size] on the others.
void check_stage_input(std::string_view who, int stage, bool first, const at::Tensor& input,
                       int64_t hidden_size);

/// The sizes of a stage's input and output for `batch` sequences of `seq` tokens.
[[nodiscard]] std::vector<int64_t> stage_input_sizes(bool first, int64_t batch, int64_t seq,
                                                     int64_t hidden_size);
[[nodiscard]] std::vector<int64_t> stage_output_sizes(bool last, int64_t batch, int64_t seq,
                                                      int64_t hidden_size, int64_t vocab_size);

/// The LM head of hidden states `h`: `lm_head`, or the tied embedding's weight (in h's dtype).
[[nodiscard]] at::Tensor tied_head(const at::Tensor& h, Linear& lm_head,
                                   const torch::nn::Embedding& embed_tokens);

/// The modules of a stage, as register_stage_modules registered them (null where the stage has
/// none).
template <class Layer>
struct StageModules {
  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<Layer> layers;
  RmsNorm norm{nullptr};
  Linear lm_head{nullptr};
};

/// Registers a stage's modules on `stage` under Qwen3ForCausalLM's names: a "model" child with
/// "embed_tokens" (first stage), "layers.<global index>" (`make_layer(i)` for i in `layers`) and
/// "norm" (last stage), and "lm_head" (last stage, untied). A tied LM head on a last stage that is
/// not the first holds its own copy of the embedding, under the embedding's name: it starts with
/// the same values (initialised by name), the parallelize layer sums the two holders' gradients
/// (d9d::parallel::detail::tie_stage_parameters) and checkpoints, export and init_from see one
/// "model.embed_tokens.weight".
template <class MakeLayer, class Layer = std::invoke_result_t<const MakeLayer&, int>>
StageModules<Layer> register_stage_modules(torch::nn::Module& stage, const Qwen3Config& config,
                                           StagePosition position, LayerRange layers,
                                           const MakeLayer& make_layer) {
  StageModules<Layer> out;
  auto body = std::make_shared<torch::nn::Module>();
  if (position.first || (position.last && config.tie_word_embeddings)) {
    out.embed_tokens = body->register_module(
        "embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  }
  auto layer_list = std::make_shared<torch::nn::Module>();
  for (int i = layers.begin; i < layers.end; ++i) {
    out.layers.emplace_back(layer_list->register_module(std::to_string(i), make_layer(i)));
  }
  body->register_module("layers", layer_list);
  if (position.last) {
    out.norm = body->register_module("norm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  }
  stage.register_module("model", body);
  if (position.last && !config.tie_word_embeddings) {
    out.lm_head = stage.register_module("lm_head", Linear(config.hidden_size, config.vocab_size));
  }
  return out;
}

}  // namespace d9d::model::detail
