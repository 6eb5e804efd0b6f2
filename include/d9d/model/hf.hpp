// d9d/model/hf.hpp — Hugging Face checkpoints: a directory with config.json and model.safetensors,
// or model.safetensors.index.json and its shards (model-00001-of-0000N.safetensors, ...).
//
//   auto model = d9d::model::load_hf_qwen3("Qwen3-0.6B/");  // from transformers' save_pretrained
//   d9d::model::save_hf_checkpoint(*model, "out/", model->config().to_hf_json(), at::kBFloat16);
//   // transformers: Qwen3ForCausalLM.from_pretrained("out/") gives the same logits
//
// Parameters map by name: d9d's modules use Hugging Face's names
// ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"), so loading is a checked copy per name. A
// tied LM head is not saved (as transformers does) and an "lm_head.weight" in a tied checkpoint is
// ignored. Loading reads config.json with Qwen3Config::from_json_text (transformers 4 and 5
// configs; d9d/model/qwen3.hpp lists the keys accepted and rejected), prefers model.safetensors
// when both layouts are present (as transformers does), checks every name, shape and dtype against
// the model's parameters from the file headers before copying anything, then copies tensor by
// tensor from the mapped files (each file's pages dropped after its tensor), so memory stays
// bounded by the model plus one tensor. Saving writes one file (sharded saving:
// d9d/state/safetensors_sharded.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <d9d/model/qwen3.hpp>

namespace d9d::model {

/// Writes every parameter of `model` (on the CPU, in `dtype`) to dir/model.safetensors with
/// {"format": "pt"} metadata, and `config_json` to dir/config.json (skipped when empty); creates
/// `dir`. Each file is written to a temporary name first.
void save_hf_checkpoint(const torch::nn::Module& model, const std::string& dir,
                        const std::string& config_json, at::ScalarType dtype = at::kFloat);

/// Streams a Hugging Face checkpoint one tensor at a time (only the tensor being written is held):
/// dir/model.safetensors with the tensors `shapes` names, in that order, each converted to `dtype`
/// on the CPU, and dir/config.json (skipped when empty) at commit(). For models whose parameters
/// are sharded (the trainer gathers each one in turn) or larger than host memory.
///
///   d9d::model::HfCheckpointWriter out("out/", config.to_hf_json(), {{"w", {4, 4}}},
///   at::kBFloat16); out.write("w", w);   // in order; std::invalid_argument for another shape
///   out.commit();        // std::logic_error when a tensor is missing
class HfCheckpointWriter {
 public:
  HfCheckpointWriter(const std::string& dir, std::string config_json,
                     const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                     at::ScalarType dtype = at::kFloat);
  ~HfCheckpointWriter();
  HfCheckpointWriter(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter& operator=(const HfCheckpointWriter&) = delete;
  HfCheckpointWriter(HfCheckpointWriter&&) = delete;
  HfCheckpointWriter& operator=(HfCheckpointWriter&&) = delete;

  void write(const std::string& name, const at::Tensor& tensor);
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Copies dir/model.safetensors, or when there is none the shards dir/model.safetensors.index.json
/// lists, into `model` by name, each tensor converted to its parameter's dtype and device.
/// std::runtime_error listing the parameters the checkpoint lacks, its tensors no parameter takes
/// (except those in `ignore`), shape mismatches and tensors that are not floating point — all
/// checked before any copy; also for an index that does not match its shards, or a directory with
/// neither file.
void load_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                        const std::vector<std::string>& ignore = {});

/// dir/config.json (Qwen3Config::from_json_text) and its weights (load_hf_checkpoint) as a new
/// model.
[[nodiscard]] Qwen3ForCausalLM load_hf_qwen3(const std::string& dir);

/// The text of a whole file (std::runtime_error naming it when it cannot be read).
[[nodiscard]] std::string read_text_file(const std::string& path);

}  // namespace d9d::model
