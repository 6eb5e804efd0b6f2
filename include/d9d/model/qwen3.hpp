// d9d/model/qwen3.hpp — the Qwen3 dense causal language model, white-box.
//
//   auto config = d9d::model::Qwen3Config::from_json_text(config_json_text);  // throws if unsure
//   d9d::model::Qwen3ForCausalLM model(config);
//   at::Tensor logits = model(input_ids);                     // [B, T] -> [B, T, vocab]
//   auto out = d9d::model::generate(*model, {{1, 2, 3}}, {.max_new_tokens = 8});  // KV cache
//
// Embedding, decoder layers (RMSNorm -> GQA with QK-norm and RoPE -> residual, RMSNorm -> SwiGLU
// -> residual), final RMSNorm and an LM head that is tied to the embedding or separate. Parameter
// names match Hugging Face's Qwen3ForCausalLM ("model.layers.0.self_attn.q_proj.weight", ...).
//
// The config is Hugging Face's Qwen3 config.json, as transformers 4 (top-level "rope_theta",
// "rope_scaling") and 5 ("rope_parameters": {"rope_type", "rope_theta"}) write it; the trainer's
// "model" section is read the same way. Reading cannot silently give another model: every key is
//   - read: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
//     num_key_value_heads, head_dim, rms_norm_eps and the rope theta ("rope_theta", or inside
//     "rope_parameters" / "rope_scaling"; when given twice the values must agree) are required;
//     tie_word_embeddings (false), max_position_embeddings (32768) and initializer_range (0.02)
//     are optional, with transformers' Qwen3 defaults;
//   - accepted only with the value d9d implements: model_type "qwen3"; hidden_act "silu";
//     attention_bias false; attention_dropout 0; use_sliding_window false; layer_types all
//     "full_attention" (one per layer); rope type ("rope_type" or "type" in "rope_parameters" /
//     "rope_scaling") "default", so "linear", "dynamic", "yarn", "longrope", "llama3", ... are
//     rejected, as is any RoPE parameter but rope_theta; pruned_heads {}; is_encoder_decoder,
//     add_cross_attention, tie_encoder_decoder false; cross_attention_hidden_size null;
//   - rejected whenever set: quantization_config, auto_map (custom modeling code);
//   - accepted and ignored, as they do not change what the model computes: architectures,
//     transformers_version, _name_or_path, dtype, torch_dtype; bos/eos/pad/sep/
//     decoder_start_token_id (d9d gives pad_token_id's embedding row no special treatment, where
//     transformers zeroes its gradient); use_cache and the generation settings transformers 4
//     keeps in the config (max_length, do_sample, num_beams, temperature, top_k, top_p, ...);
//     output_attentions, output_hidden_states, return_dict, torchscript; id2label, label2id,
//     num_labels, problem_type, finetuning_task, task_specific_params, tokenizer_class, prefix;
//     use_bfloat16, tf_legacy_loss, chunk_size_feed_forward, is_decoder; sliding_window and
//     max_window_layers (used only with a sliding window); attn_implementation and its private
//     variants. The full list is kIgnoredKeys in src/model/qwen3_config.cpp.
// Any other key is an error naming it, with the closest known key ("did you mean ...?"). A null
// value counts as absent, as in transformers. Sizes are integers from 1 to 2^31 - 1; numbers must
// be finite; a key given twice is an error.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include <d9d/model/block.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/model/embedding_rows.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/tensor_parallel.hpp>

namespace d9d::model {

/// Qwen3 hyper-parameters, named as in Hugging Face's config.json. The member defaults of the
/// shape (vocab_size ... rope_theta) are Qwen3-0.6B's, for configs built in C++; from_json_text
/// requires those keys. The optional ones default to transformers' Qwen3Config defaults.
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
  bool tie_word_embeddings = false;
  /// Not used by the computation (the default RoPE has no length limit); kept for the export.
  int64_t max_position_embeddings = 32768;
  /// Standard deviation of the normal initialisation of linear and embedding weights.
  double initializer_range = 0.02;

  /// Parses a config.json text (transformers 4 or 5; the keys and rules in the file comment) and
  /// validates it; std::invalid_argument "d9d Qwen3 config: ..." names the key, the value and what
  /// would be valid.
  static Qwen3Config from_json_text(const std::string& text);
  /// Throws std::invalid_argument unless every field is usable (sizes from 1 to 2^31 - 1, heads
  /// dividing, an even head_dim, finite positive eps, theta and initializer range).
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
  /// Placed tokens (d9d::model::TokenPlacement), reading and extending `cache` (may be null).
  at::Tensor forward_placed(const at::Tensor& x, const TokenPlacement& where, KvCacheLayer* cache);

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
  /// input_ids [B, T] placed by `where` (place_tokens / place_documents with rope()), writing their
  /// keys and values into `cache` (may be null; its length is not advanced here).
  at::Tensor forward_placed(const at::Tensor& input_ids, const TokenPlacement& where,
                            KvCache* cache);
  /// The rotary embedding of the layers (for placements).
  [[nodiscard]] const RotaryEmbedding& rope() const { return rope_; }
  /// The token embedding of `input_ids`; vocab-parallel under tensor parallelism (this rank's
  /// rows start at id `vocab_start`, other ids embed as zeros, the parts summed over the group).
  at::Tensor embed(const at::Tensor& input_ids);
  /// Tensor parallelism of the embedding (set by Qwen3ForCausalLM::set_tensor_parallel).
  void set_vocab_parallel(std::shared_ptr<const TensorParallelGroup> group, int64_t vocab_start);
  /// Lookups deferred to `sink` while it says so (set by Qwen3ForCausalLM::set_embedding_row_sink;
  /// d9d/model/embedding_rows.hpp).
  void set_embedding_row_sink(std::shared_ptr<EmbeddingRowSink> sink);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};

 private:
  RotaryEmbedding rope_;
  std::shared_ptr<const TensorParallelGroup> tp_;
  int64_t vocab_start_ = 0;
  std::shared_ptr<EmbeddingRowSink> row_sink_;
};
TORCH_MODULE(Qwen3Model);

/// Sum of token cross-entropies over labels != ignore_index, and the number of such tokens, so
/// the loss can be averaged over every token of every microbatch and rank.
struct CausalLmLoss {
  at::Tensor loss_sum;  ///< scalar, float32
  at::Tensor tokens;    ///< scalar, int64
};
/// The causal LM: Qwen3Model + LM head (tied to embed_tokens when tie_word_embeddings).
/// Under tensor parallelism (VocabParallelModel, d9d/model/tensor_parallel.hpp) the embedding and
/// the head hold this rank's slice of the vocabulary and loss() is the loss-parallel
/// cross-entropy; forward() gathers the logits.
///
/// Under context parallelism (ContextParallelModel, d9d/model/context_parallel.hpp) loss() runs on
/// this rank's two chunks of each sequence: the ids, the labels, the positions and a given
/// placement are cut alike (context_shard) and the attention layers attend over every rank's keys;
/// forward() and forward_placed() refuse (they would return a part of the logits).
class Qwen3ForCausalLMImpl : public torch::nn::Module,
                             public VocabParallelModel,
                             public ContextParallelModel,
                             public EmbeddingRowsModel {
 public:
  explicit Qwen3ForCausalLMImpl(Qwen3Config config);
  /// input_ids [B, T] -> logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& input_ids);
  /// input_ids [B, T] placed by `where`, reading and writing `cache` (may be null; the caller
  /// advances cache->length): the logits of the last `last` positions [B, last, vocab] (all T when
  /// `last` is 0), so decoding never computes the head over a whole prompt.
  at::Tensor forward_placed(const at::Tensor& input_ids, const TokenPlacement& where,
                            KvCache* cache, int64_t last = 0);
  /// An empty KV cache for `batch` rows of up to `capacity` positions, in `options` (the dtype and
  /// device of the activations).
  [[nodiscard]] KvCache make_cache(int64_t batch, int64_t capacity,
                                   const at::TensorOptions& options) const;
  [[nodiscard]] int64_t vocab_size() const override { return config_.vocab_size; }
  [[nodiscard]] std::vector<std::string> vocab_parameters() const override;
  void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) override;
  /// Context parallelism over `group`: set on the model and every attention layer.
  void set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) override;
  [[nodiscard]] at::Tensor embedding_weight() const override;
  [[nodiscard]] bool embedding_tied() const override { return config_.tie_word_embeddings; }
  void set_embedding_row_sink(std::shared_ptr<EmbeddingRowSink> sink) override;
  /// The causal-LM loss of predicting `labels` [B, T] from `input_ids` [B, T]: the head and the
  /// cross-entropy fused and chunked (d9d::model::linear_cross_entropy) when fused_kernels(), so
  /// the logits never exist whole; else (or when lm_head has an adapter, d9d/peft/lora.hpp)
  /// causal_lm_loss(forward(input_ids), labels). Under tensor parallelism: this rank's logits
  /// (of its vocabulary slice) through TensorParallelGroup::cross_entropy_sum.
  /// With `where` (e.g. place_documents for packed documents) the tokens are placed by it.
  [[nodiscard]] CausalLmLoss loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                  int64_t ignore_index = -100,
                                  const TokenPlacement* where = nullptr);
  [[nodiscard]] const Qwen3Config& config() const { return config_; }

  Qwen3Model model{nullptr};
  Linear lm_head{nullptr};  ///< null when tied

 private:
  /// The head's logits of `hidden` [..., hidden]: this rank's vocabulary slice under tensor
  /// parallelism.
  at::Tensor head_logits(const at::Tensor& hidden);
  /// The loss of `labels` from the final hidden states.
  CausalLmLoss loss_of(const at::Tensor& hidden, const at::Tensor& labels, int64_t ignore_index);
  /// loss() under context parallelism: this rank's chunks, placed.
  CausalLmLoss context_loss(const at::Tensor& input_ids, const at::Tensor& labels,
                            int64_t ignore_index, const TokenPlacement* where);
  /// std::logic_error under context parallelism (`what` names the call).
  void refuse_context_parallel(const char* what) const;
  Qwen3Config config_;
  std::shared_ptr<const TensorParallelGroup> tp_;
  std::shared_ptr<const ContextParallelGroup> cp_;
};
TORCH_MODULE(Qwen3ForCausalLM);

/// How d9d::model::generate continues prompts.
struct GenerationOptions {
  /// New tokens per prompt at most.
  int64_t max_new_tokens = 32;
  /// 0: greedy (the most likely token); > 0: sampling from softmax(logits / temperature).
  double temperature = 0.0;
  /// Sampling only from the smallest set of most likely tokens whose probability reaches top_p
  /// (nucleus sampling); 1: all tokens. In (0, 1].
  double top_p = 1.0;
  /// A row ends after producing one of these (it is included in its continuation).
  std::vector<int64_t> stop_tokens{};
  /// The seed of the sampling generator (the same seed, prompts and model give the same tokens).
  uint64_t seed = 0;
  /// false: the whole sequence runs again for every new token, without a KV cache (the reference
  /// the cache is tested against).
  bool use_cache = true;
};

/// Continuations of `prompts` (token ids, each at least one; lengths may differ: the batch is
/// left-padded, padding masked out and positions counted per row, so each row continues exactly as
/// it would alone): per prompt its new tokens, at most max_new_tokens, ending with a stop token
/// when one came. Runs without gradients, in eval mode (restored after), on the model's device and
/// in its parameters' dtype. std::invalid_argument for an empty prompt, ids outside the
/// vocabulary or options out of range.
[[nodiscard]] std::vector<std::vector<int64_t>> generate(
    Qwen3ForCausalLMImpl& model, const std::vector<std::vector<int64_t>>& prompts,
    const GenerationOptions& options);

/// One 64-bit draw of the default CPU generator: the seed of init_qwen3_parameters. The model and
/// stage constructors draw it first, before their submodules draw anything.
[[nodiscard]] uint64_t draw_init_seed();

/// Hugging Face's initialisation of a Qwen3 module (the whole model or a pipeline stage): ones
/// for the norm weights, normal(0, initializer_range) for the rest. Each parameter is drawn from
/// its own generator, seeded from `seed` and the parameter's name, so a stage gets exactly the
/// values its parameters have in the whole model built after the same torch::manual_seed,
/// whatever the split.
void init_qwen3_parameters(torch::nn::Module& module, const Qwen3Config& config, uint64_t seed);

namespace detail {
/// Every key the Qwen3 config reader knows (read, checked, rejected or ignored), in its
/// did-you-mean order; other readers built on it (Qwen3-MoE) suggest among these and their own.
[[nodiscard]] std::vector<std::string_view> qwen3_config_keys();
}  // namespace detail

CausalLmLoss causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t ignore_index = -100);

}  // namespace d9d::model
