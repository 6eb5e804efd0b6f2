// d9d/model/qwen3_moe.hpp — Qwen3-MoE, white-box: Qwen3's attention with sparse MoE blocks.
//
//   auto config = d9d::model::Qwen3MoeConfig::from_json_text(json_text);  // throws if unsure
//   d9d::model::Qwen3MoeForCausalLM model(config);
//   at::Tensor logits = model(input_ids);              // [B, T] -> [B, T, vocab]
//   double aux = model->last_aux_loss();               // transformers' aux loss of that pass
//
// Decoder layer i has a sparse MoE block (d9d/model/moe.hpp) when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0, else the dense SwiGLU MLP of intermediate_size, as in
// transformers. Parameter names are those of transformers' Qwen3MoeForCausalLM
// ("model.layers.0.mlp.gate.weight", ...) except the routed experts, which d9d stacks: one
// tensor per projection and layer, "model.layers.<i>.mlp.experts.{gate,up}_proj" [E, I, H] and
// ".down_proj" [E, H, I], where transformers 4 and 5 checkpoints hold
// "mlp.experts.<e>.gate_proj.weight", ... (d9d/model/hf_moe.hpp maps both ways). With a shared
// expert (shared_expert_intermediate_size > 0, the Qwen2-MoE form) the block also has
// "mlp.shared_expert.{gate,up,down}_proj.weight" and "mlp.shared_expert_gate.weight".
//
// The config reader is the dense Qwen3's (d9d/model/qwen3.hpp: every key read, checked, rejected
// or ignored, did-you-mean for unknown keys, transformers 4's "rope_theta" and 5's
// "rope_parameters") plus the MoE keys:
//   - required: num_experts (transformers 4) or num_local_experts (transformers 5 writes this
//     name; when both are given they must agree), num_experts_per_tok, moe_intermediate_size;
//   - optional with transformers' defaults: norm_topk_prob (false), decoder_sparse_step (1),
//     mlp_only_layers ([]), router_aux_loss_coef (0.001), output_router_logits (false: as in
//     transformers, the auxiliary loss trains only when it is true);
//   - the Qwen2-MoE shared expert: shared_expert_intermediate_size (0 = none; transformers'
//     Qwen3-MoE has none and ignores the key);
//   - d9d's own: router_bias_update_rate (0 = off): auxiliary-loss-free balancing, a per-expert
//     selection bias on the router logits moved by this rate after every optimizer step (not part
//     of transformers' model: an export leaves the bias out); router_bias_update_rule ("sign",
//     DeepSeek-V3's rule, the default; or "proportional": d9d::model::MoeBiasRule);
//     router_aux_loss_type ("global_batch", transformers' loss, the default; or "sequence",
//     DeepSeek-V3's sequence-wise balance loss: d9d::model::MoeAuxLoss); moe_capacity_factor (0 =
//     dropless, the default; c > 0: each expert takes at most ceil(c * tokens * k / E) routings of
//     a forward, the rest dropped: d9d::model::MoeOptions::capacity_factor).
// model_type must be "qwen3_moe" (other MoE families are refused by name).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <d9d/model/block.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/stage_layers.hpp>

namespace d9d::model {

/// Qwen3-MoE hyper-parameters: the dense Qwen3's plus the MoE ones, named as in transformers'
/// config.json. Member defaults are transformers' Qwen3MoeConfig defaults.
struct Qwen3MoeConfig : Qwen3Config {
  int64_t num_experts = 128;
  int64_t num_experts_per_tok = 8;
  int64_t moe_intermediate_size = 768;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  int64_t shared_expert_intermediate_size = 0;
  double router_bias_update_rate = 0.0;
  MoeBiasRule router_bias_update_rule = MoeBiasRule::sign;
  MoeAuxLoss router_aux_loss_type = MoeAuxLoss::global_batch;
  double moe_capacity_factor = 0.0;  ///< d9d's own: token dropping (0: dropless)

  /// Parses a config.json text (the rules in the file comment); std::invalid_argument
  /// "d9d Qwen3-MoE config: ..." names the key, the value and what would be valid.
  static Qwen3MoeConfig from_json_text(const std::string& text);
  void validate() const;
  /// transformers' config.json (transformers 4's names, which 5 reads too).
  [[nodiscard]] std::string to_hf_json(const std::string& torch_dtype = "float32") const;
  /// Whether decoder layer `layer` has a sparse MoE block.
  [[nodiscard]] bool is_moe_layer(int64_t layer) const;
  /// The options of layer's MoE block.
  [[nodiscard]] MoeOptions moe_options() const;
  /// The auxiliary loss's coefficient in training: router_aux_loss_coef when
  /// output_router_logits, else 0 (transformers adds the loss only then).
  [[nodiscard]] double aux_loss_coef() const;
  [[nodiscard]] int64_t parameter_count() const;
  /// Parameters one token uses (top-k of the experts): what MFU of a MoE counts.
  [[nodiscard]] int64_t active_parameter_count() const;
  [[nodiscard]] int64_t active_non_embedding_parameter_count() const;
};

/// One decoder layer (a d9d::model::Block): attention and a MoE block or a dense MLP ("mlp").
class Qwen3MoeDecoderLayerImpl : public torch::nn::Module, public Block {
 public:
  Qwen3MoeDecoderLayerImpl(const Qwen3MoeConfig& config, int64_t layer_index);
  at::Tensor forward(const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& cos_sin,
                     const std::shared_ptr<MoeForwardStats>& stats);

  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  MoeLayer moe{nullptr};  ///< "mlp" in a sparse layer
  SwiGlu mlp{nullptr};    ///< "mlp" in a dense layer
};
TORCH_MODULE(Qwen3MoeDecoderLayer);

/// Embedding + decoder layers + final norm: hidden states.
class Qwen3MoeModelImpl : public torch::nn::Module {
 public:
  explicit Qwen3MoeModelImpl(const Qwen3MoeConfig& config);
  at::Tensor forward(const at::Tensor& input_ids, const std::shared_ptr<MoeForwardStats>& stats);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};

 private:
  RotaryEmbedding rope_;
};
TORCH_MODULE(Qwen3MoeModel);

/// The causal LM (untied or tied LM head, as Qwen3ForCausalLM).
class Qwen3MoeForCausalLMImpl : public torch::nn::Module {
 public:
  explicit Qwen3MoeForCausalLMImpl(Qwen3MoeConfig config);
  /// input_ids [B, T] -> logits [B, T, vocab]; records the pass's routing statistics.
  at::Tensor forward(const at::Tensor& input_ids);
  /// The causal-LM loss of predicting `labels` [B, T] from `input_ids` [B, T], as
  /// Qwen3ForCausalLM::loss: the head and the cross-entropy fused and chunked
  /// (d9d::model::linear_cross_entropy) when fused_kernels(), else causal_lm_loss(forward(...)).
  [[nodiscard]] CausalLmLoss loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                  int64_t ignore_index = -100);
  [[nodiscard]] const Qwen3MoeConfig& config() const { return config_; }
  /// transformers' auxiliary loss of the last forward pass (0 before any).
  [[nodiscard]] double last_aux_loss() const;

  Qwen3MoeModel model{nullptr};
  Linear lm_head{nullptr};  ///< null when tied

 private:
  Qwen3MoeConfig config_;
  std::shared_ptr<MoeForwardStats> last_stats_;
};
TORCH_MODULE(Qwen3MoeForCausalLM);

/// A pipeline stage of Qwen3MoeForCausalLM (as d9d::model::Qwen3Stage): the whole model's
/// parameter names, stage 0 holds the embedding, the last one the norm and the LM head. The
/// auxiliary loss is pooled over the stage's MoE layers and weighted by the stage's share of the
/// model's MoE layers, so the gradient it adds over all layers is the whole model's when the
/// stages route alike (each stage's f and P are its own layers'; design 0009).
class Qwen3MoeStageImpl : public torch::nn::Module {
 public:
  Qwen3MoeStageImpl(const Qwen3MoeConfig& config, int stage, int stages, LayerRange layers);
  at::Tensor forward(const at::Tensor& input);
  [[nodiscard]] std::vector<int64_t> input_sizes(int64_t batch, int64_t seq) const;
  [[nodiscard]] std::vector<int64_t> output_sizes(int64_t batch, int64_t seq) const;
  [[nodiscard]] bool is_first() const { return stage_ == 0; }
  [[nodiscard]] bool is_last() const { return stage_ == stages_ - 1; }
  [[nodiscard]] const Qwen3MoeConfig& config() const { return config_; }

  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<Qwen3MoeDecoderLayer> layers;
  RmsNorm norm{nullptr};
  Linear lm_head{nullptr};

 private:
  Qwen3MoeConfig config_;
  int stage_;
  int stages_;
  double moe_share_ = 1.0;  ///< the stage's MoE layers over the model's
  RotaryEmbedding rope_;
};
TORCH_MODULE(Qwen3MoeStage);

}  // namespace d9d::model
