// d9d/model/qwen3_stage.hpp — one pipeline stage of Qwen3: only that stage's layers.
//
//   const auto ranges = d9d::model::distribute_layers(config.num_hidden_layers, stages);
//   d9d::model::Qwen3Stage stage(config, /*stage=*/s, /*stages=*/stages, ranges[s]);
//   at::Tensor out = stage(in);   // ids [B, T] on stage 0; hidden [B, T, H] between; logits last
//   stage->output_sizes(B, T);    // known without running the model
//
// Stage 0 holds the embedding, the last stage the final norm and the LM head, every stage its
// range of decoder layers. Parameter names are those of the whole Qwen3ForCausalLM
// ("model.layers.5.mlp.up_proj.weight", "lm_head.weight"), so checkpoints and a full model's
// parameters map onto stages by name (copy_parameters). With tie_word_embeddings = true the last
// stage (when it is not also the first) holds its own copy of the embedding, registered under the
// same name "model.embed_tokens.weight" and used as the LM head: it starts with the first stage's
// values (init_qwen3_parameters draws by name), and the parallelize layer sums the two holders'
// gradients after each step (d9d::parallel::detail::tie_stage_parameters), so both stay
// bit-identical. Checkpoints, export and "checkpoint.init_from" see one
// "model.embed_tokens.weight" (the copy is marked ParameterRecord::tied_copy).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/modules/embedding.h>

#include <d9d/model/context_parallel.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/stage_layers.hpp>
#include <d9d/model/tensor_parallel.hpp>

namespace d9d::model {

/// A contiguous slice of Qwen3ForCausalLM for pipeline stage `stage` of `stages`. Under tensor
/// parallelism (VocabParallelModel) the first stage's embedding and the last stage's head hold
/// this rank's vocabulary slice; the last stage gathers the logits over tp (its output stays
/// [B, T, vocab]). With sequence parallelism the hidden states between stages are this rank's
/// shard of the tokens, [B, T / tp, H] (the embedding scatters them, the head gathers them back;
/// TensorParallelGroup::copy_in says which tokens). Under
/// context parallelism (ContextParallelModel) the first stage keeps this rank's two chunks of each
/// sequence (context_shard), every stage runs its layers on those T / cp tokens at their positions,
/// and the last stage's logits are theirs ([B, T / cp, vocab]: the task's loss cuts its labels
/// alike, d9d::SequencePart).
class Qwen3StageImpl : public torch::nn::Module,
                       public VocabParallelModel,
                       public ContextParallelModel {
 public:
  Qwen3StageImpl(const Qwen3Config& config, int stage, int stages, LayerRange layers);
  /// Stage 0: input_ids [B, T] (int64); others: hidden [B, T, hidden] (T / cp tokens under
  /// context parallelism). Returns hidden states, or logits [B, T, vocab] on the last stage.
  at::Tensor forward(const at::Tensor& input);
  [[nodiscard]] int64_t vocab_size() const override { return config_.vocab_size; }
  [[nodiscard]] std::vector<std::string> vocab_parameters() const override;
  void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) override;
  /// The last stage under tensor parallelism: its output becomes this rank's vocabulary slice of
  /// the logits ([B, T, V / tp]); other stages (no logits) and no tp: a whole slice.
  VocabSlice keep_logits_split() override;
  void set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) override;

  [[nodiscard]] bool is_first() const { return stage_ == 0; }
  [[nodiscard]] bool is_last() const { return stage_ == stages_ - 1; }
  [[nodiscard]] int stage() const { return stage_; }
  [[nodiscard]] LayerRange layer_range() const { return range_; }
  [[nodiscard]] const Qwen3Config& config() const { return config_; }
  /// Sizes of this stage's input and output for a microbatch of `batch` sequences of `seq` tokens
  /// (under context parallelism the hidden states and logits hold seq / cp of them).
  [[nodiscard]] std::vector<int64_t> input_sizes(int64_t batch, int64_t seq) const;
  [[nodiscard]] std::vector<int64_t> output_sizes(int64_t batch, int64_t seq) const;

  /// Stage 0, and a tied last stage ("model.embed_tokens")
  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<Qwen3DecoderLayer> layers;  ///< "model.layers.<global index>"
  RmsNorm norm{nullptr};                  ///< last stage only ("model.norm")
  Linear lm_head{nullptr};                ///< last stage only, untied ("lm_head")

 private:
  Qwen3Config config_;
  /// The tokens of a sequence this rank computes on (seq / cp under context parallelism).
  [[nodiscard]] int64_t local_tokens(int64_t seq) const;
  /// The tokens of a sequence in the hidden states between stages: local_tokens, divided by tp
  /// under sequence parallelism (std::invalid_argument when tp does not divide them).
  [[nodiscard]] int64_t hidden_tokens(int64_t seq) const;

  std::shared_ptr<const TensorParallelGroup> tp_;
  std::shared_ptr<const ContextParallelGroup> cp_;
  int64_t vocab_start_ = 0;
  bool split_logits_ = false;
  int stage_;
  int stages_;
  LayerRange range_;
  RotaryEmbedding rope_;
};
TORCH_MODULE(Qwen3Stage);

/// Copies every parameter of `to` from the parameter of the same name in `from` (e.g. a full
/// model into a stage); std::invalid_argument names a parameter missing in `from` or of another
/// shape.
void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to);

}  // namespace d9d::model
