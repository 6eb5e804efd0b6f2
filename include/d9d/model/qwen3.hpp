// d9d/model/qwen3.hpp — the Qwen3 dense causal language model, white-box.
//
//   auto config = d9d::model::Qwen3Config::from_json_text(R"({"hidden_size": 256, ...})");
//   d9d::model::Qwen3ForCausalLM model(config);
//   at::Tensor logits = model(input_ids);                     // [B, T] -> [B, T, vocab]
//
// Embedding, decoder layers (RMSNorm -> GQA with QK-norm and RoPE -> residual, RMSNorm -> SwiGLU
// -> residual), final RMSNorm and an LM head that is tied to the embedding or separate. Parameter
// names match Hugging Face's Qwen3ForCausalLM ("model.layers.0.self_attn.q_proj.weight", ...).
// The config mirrors the fields of Hugging Face's Qwen3 config.json.
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <d9d/model/block.hpp>
#include <d9d/model/layers.hpp>

namespace d9d::model {

/// Qwen3 hyper-parameters, named as in Hugging Face's config.json.
struct Qwen3Config {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 1024;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 28;
  int64_t num_attention_heads = 16;
  int64_t num_key_value_heads = 8;
  int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  bool tie_word_embeddings = true;
  int64_t max_position_embeddings = 40960;
  /// Standard deviation of the normal initialisation of linear and embedding weights.
  double initializer_range = 0.02;

  /// Parses a config.json text (Hugging Face keys; unknown keys are ignored, as transformers does)
  /// and validates it; std::invalid_argument names the key, the value and what would be valid.
  static Qwen3Config from_json_text(const std::string& text);
  /// Throws std::invalid_argument unless every field is usable (positive sizes, heads dividing...).
  void validate() const;
  /// A Hugging Face config.json for this model (architectures, model_type, torch_dtype, fields).
  [[nodiscard]] std::string to_hf_json(const std::string& torch_dtype = "float32") const;
  /// Parameters of the whole model, and those outside the embedding and the LM head.
  [[nodiscard]] int64_t parameter_count() const;
  [[nodiscard]] int64_t non_embedding_parameter_count() const;
};

/// One decoder layer: a d9d::model::Block (the unit of fully sharded data parallelism and of
/// activation recompute).
class Qwen3DecoderLayerImpl : public torch::nn::Module, public Block {
 public:
  explicit Qwen3DecoderLayerImpl(const Qwen3Config& config);
  at::Tensor forward(const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& cos_sin);

  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  SwiGlu mlp{nullptr};
};
TORCH_MODULE(Qwen3DecoderLayer);

/// Embedding + decoder layers + final norm: hidden states.
class Qwen3ModelImpl : public torch::nn::Module {
 public:
  explicit Qwen3ModelImpl(const Qwen3Config& config);
  /// input_ids [B, T] (int64) -> hidden states [B, T, hidden].
  at::Tensor forward(const at::Tensor& input_ids);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};

 private:
  RotaryEmbedding rope_;
};
TORCH_MODULE(Qwen3Model);

/// The causal LM: Qwen3Model + LM head (tied to embed_tokens when tie_word_embeddings).
class Qwen3ForCausalLMImpl : public torch::nn::Module {
 public:
  explicit Qwen3ForCausalLMImpl(Qwen3Config config);
  /// input_ids [B, T] -> logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& input_ids);
  [[nodiscard]] const Qwen3Config& config() const { return config_; }

  Qwen3Model model{nullptr};
  Linear lm_head{nullptr};  ///< null when tied

 private:
  Qwen3Config config_;
};
TORCH_MODULE(Qwen3ForCausalLM);

/// One 64-bit draw of the default CPU generator: the seed of init_qwen3_parameters. The model and
/// stage constructors draw it first, before their submodules draw anything.
[[nodiscard]] uint64_t draw_init_seed();

/// Hugging Face's initialisation of a Qwen3 module (the whole model or a pipeline stage): ones
/// for the norm weights, normal(0, initializer_range) for the rest. Each parameter is drawn from
/// its own generator, seeded from `seed` and the parameter's name, so a stage gets exactly the
/// values its parameters have in the whole model built after the same torch::manual_seed,
/// whatever the split.
void init_qwen3_parameters(torch::nn::Module& module, const Qwen3Config& config, uint64_t seed);

/// Sum of token cross-entropies over labels != ignore_index, and the number of such tokens, so
/// the loss can be averaged over every token of every microbatch and rank.
struct CausalLmLoss {
  at::Tensor loss_sum;  ///< scalar, float32
  at::Tensor tokens;    ///< scalar, int64
};
CausalLmLoss causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t ignore_index = -100);

}  // namespace d9d::model
