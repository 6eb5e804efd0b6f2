// d9d/train/causal_lm.hpp — ready-made providers and task for causal language-model training.
//
//   d9d::Trainer<MyPlan> trainer{ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
//                                d9d::CausalLmTask{}, cfg};
//
// Qwen3Provider (a d9d::model_provider) builds Qwen3ForCausalLM from the config's "model" section
// (Hugging Face config.json keys). TokenFilesProvider (a d9d::dataset_provider) reads the "data"
// section {"paths": [...], "token_width": "u16" | "u32"} as a d9d::data::TokenDataset whose
// samples are sequence_length + 1 tokens. CausalLmTask (a d9d::train_task) feeds tokens[:, :-1]
// and predicts tokens[:, 1:], returning the summed cross-entropy and the number of target tokens.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <boost/hana/define_struct.hpp>

#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/model/qwen3_stage.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/train/concepts.hpp>

namespace d9d {

/// A batch of token windows: int64 [B, sequence_length + 1].
struct CausalLmBatch {
  BOOST_HANA_DEFINE_STRUCT(CausalLmBatch, (at::Tensor, tokens));
};

/// Builds Qwen3ForCausalLM from the "model" section, or under a pipeline plan one stage of it
/// (d9d::model::Qwen3Stage; decoder layers spread by d9d::model::distribute_layers with the
/// embedding and the LM head weighed by d9d::model::pipeline_virtual_layers at the run's sequence
/// length). Both initialise parameters by name, so a
/// stage starts with the whole model's values. A tied head on several stages: the last stage holds
/// a copy of the embedding under its name (d9d/model/qwen3_stage.hpp).
class Qwen3Provider {
 public:
  using model_provider_concept = model_provider_tag;
  model::Qwen3ForCausalLM build(const ModelBuildContext& context);
  model::Qwen3Stage build_stage(const StageBuildContext& context);
  /// The exported config.json (after build()).
  [[nodiscard]] std::string hf_config_json() const;
  /// Checkpoint keys -> `names` ("checkpoint.init_from"): the same names; a tied model's stored
  /// "lm_head.weight" dropped.
  [[nodiscard]] state::Mapper hf_load_mapper(const std::vector<std::string>& source_keys,
                                             const std::vector<std::string>& names) const;
  [[nodiscard]] const model::Qwen3Config& config() const { return config_; }

 private:
  model::Qwen3Config config_;
};

/// Builds Qwen3MoeForCausalLM from the "model" section (a transformers Qwen3-MoE config.json,
/// d9d/model/qwen3_moe.hpp), or under a pipeline plan one stage of it (d9d::model::Qwen3MoeStage).
/// The export writes transformers' per-expert tensors (hf_export_mapper).
class Qwen3MoeProvider {
 public:
  using model_provider_concept = model_provider_tag;
  model::Qwen3MoeForCausalLM build(const ModelBuildContext& context);
  model::Qwen3MoeStage build_stage(const StageBuildContext& context);
  [[nodiscard]] std::string hf_config_json() const;
  /// Model parameter names -> transformers' tensor names (the stacked experts unstacked).
  [[nodiscard]] state::Mapper hf_export_mapper(const std::vector<std::string>& names) const;
  /// transformers' tensor names -> `names` (the experts stacked; d9d::model::
  /// qwen3_moe_hf_load_mapper), for "checkpoint.init_from".
  [[nodiscard]] state::Mapper hf_load_mapper(const std::vector<std::string>& source_keys,
                                             const std::vector<std::string>& names) const;
  [[nodiscard]] const model::Qwen3MoeConfig& config() const { return config_; }

 private:
  model::Qwen3MoeConfig config_;
};

/// Token windows from files (d9d::data::TokenDataset), as CausalLmBatch.
class TokenWindows {
 public:
  /// With `vocab_size` > 0 every token id is checked to be below it when the files are opened
  /// (d9d::data::TokenDataset::check_vocab).
  TokenWindows(std::vector<std::string> paths, const std::string& token_width,
               int64_t sequence_length, int64_t vocab_size = 0);
  [[nodiscard]] int64_t size() const;
  [[nodiscard]] CausalLmBatch get(const std::vector<int64_t>& indices) const;
  /// Largest token id + 1 (reads every file once, then cached).
  [[nodiscard]] int64_t vocab_bound() const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

/// Reads the "data" section: {"paths": [...], "token_width": "u16" | "u32"}.
class TokenFilesProvider {
 public:
  using dataset_provider_concept = dataset_provider_tag;
  TokenWindows build(const DataBuildContext& context);
};

/// How CausalLmTask treats the documents inside a window.
struct CausalLmOptions {
  /// The id that ends every document (d9d::data::ByteTokenizer::end_of_text for tools/tokenize's
  /// files), or -1: a window is one sequence, attention crosses document boundaries. With a
  /// separator the documents packed into a window are kept apart: positions restart after each
  /// separator, a token attends only to its own document (d9d::model::place_documents), and the
  /// separator's own prediction (the next document's first token) is not a target. Dense Qwen3
  /// without a pipeline plan.
  int64_t document_separator = -1;
};

/// Next-token prediction with the summed loss and the number of target tokens as its weight.
/// Under a pipeline plan the first stage reads stage_input (tokens[:, :-1]) and the last stage's
/// logits go to output_loss (against tokens[:, 1:], this rank's part of them under context
/// parallelism), whose cross-entropy is d9d's fused kernel (model::logits_cross_entropy) unless
/// model::set_fused_kernels(false).
class CausalLmTask {
 public:
  using train_task_concept = train_task_tag;
  CausalLmTask() = default;
  explicit CausalLmTask(CausalLmOptions options) : options_(options) {}
  LossOutput compute_loss(model::Qwen3ForCausalLM& model, const CausalLmBatch& batch);
  /// The cross-entropy only: the MoE auxiliary loss adds its gradient inside the model
  /// (d9d/model/moe.hpp), and its value is a metric ("moe/aux_loss").
  LossOutput compute_loss(model::Qwen3MoeForCausalLM& model, const CausalLmBatch& batch);
  at::Tensor stage_input(const CausalLmBatch& batch);
  LossOutput output_loss(const at::Tensor& logits, const CausalLmBatch& batch);
  /// Under context parallelism: `logits` cover this rank's part of each sequence (`part`), so
  /// the labels are cut alike.
  LossOutput output_loss(const at::Tensor& logits, const CausalLmBatch& batch,
                         const SequencePart& part);
  /// Under tensor parallelism the logits may be this rank's vocabulary slice (`vocab`): the
  /// loss-parallel cross-entropy over the tp group.
  LossOutput output_loss(const at::Tensor& logits, const CausalLmBatch& batch,
                         const SequencePart& part, const VocabPart& vocab);

 private:
  CausalLmOptions options_;
};

}  // namespace d9d
