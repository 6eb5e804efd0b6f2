// d9d/model/hf.hpp — Hugging Face checkpoints: a directory with model.safetensors and config.json.
//
//   auto model = d9d::model::load_hf_qwen3("Qwen3-0.6B/");       // from transformers'
//   save_pretrained d9d::model::save_hf_checkpoint(*model, "out/", model->config().to_hf_json(),
//   at::kBFloat16);
//   // transformers: Qwen3ForCausalLM.from_pretrained("out/") gives the same logits
//
// Parameters map by name: d9d's modules use Hugging Face's names
// ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"), so loading is a checked copy per name. A
// tied LM head is not saved (as transformers does) and an "lm_head.weight" in a tied checkpoint is
// ignored. One file for now; sharded checkpoints (model.safetensors.index.json) come with the
// model-state I/O.
#pragma once

#include <string>
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

/// Copies dir/model.safetensors into `model` by name, each tensor converted to its parameter's
/// dtype and device. std::runtime_error listing the parameters the file lacks, the file's tensors
/// no parameter takes (except those in `ignore`) and shape mismatches — checked before any copy.
void load_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                        const std::vector<std::string>& ignore = {});

/// dir/config.json (Hugging Face Qwen3 keys) and dir/model.safetensors as a new model.
[[nodiscard]] Qwen3ForCausalLM load_hf_qwen3(const std::string& dir);

/// The text of a whole file (std::runtime_error naming it when it cannot be read).
[[nodiscard]] std::string read_text_file(const std::string& path);

}  // namespace d9d::model
