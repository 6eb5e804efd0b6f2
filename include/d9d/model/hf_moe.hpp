// d9d/model/hf_moe.hpp — Qwen3-MoE checkpoints of Hugging Face transformers, both ways.
//
//   auto model = d9d::model::load_hf_qwen3_moe("Qwen3-30B-A3B/");   // config.json + weights
//   d9d::model::save_hf_qwen3_moe(*model, "out/", at::kBFloat16);  // transformers reads it back
//
// transformers 4 and 5 store the routed experts one by one ("model.layers.<i>.mlp.experts.<e>.
// gate_proj.weight" [I, H], up_proj, down_proj [H, I]); d9d stacks them per layer and projection
// ("model.layers.<i>.mlp.experts.gate_proj" [E, I, H], ...). Loading streams the checkpoint through
// a state mapper (d9d/state/mapper.hpp) whose groups stack each layer's experts (a group holds one
// projection of one layer: memory stays about one stacked tensor beyond the model); transformers
// 5's in-memory layout ("mlp.experts.gate_up_proj" [E, 2I, H] and "mlp.experts.down_proj"), should
// a checkpoint hold it, is cut and renamed instead. Every other tensor maps by name. Names, shapes
// and missing or extra tensors are checked from the file headers before anything is read. Saving
// unstacks each stacked tensor into the per-expert tensors (one file, streamed one group at a
// time) and writes config.json in transformers 4's form (num_experts, top-level rope_theta), which
// transformers 5 reads as well.
#pragma once

#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <d9d/model/qwen3_moe.hpp>
#include <d9d/state/mapper.hpp>

namespace d9d::model {

/// The mapper from a transformers checkpoint holding `source_keys` to the parameters named
/// `parameter_names` of a Qwen3-MoE model (or stage) of `config`: stacks (or, for the fused
/// layout, cuts) the experts, renames nothing else, drops a tied model's stored lm_head.weight.
[[nodiscard]] state::Mapper qwen3_moe_hf_load_mapper(
    const Qwen3MoeConfig& config, const std::vector<std::string>& source_keys,
    const std::vector<std::string>& parameter_names);

/// The mapper from a Qwen3-MoE model's parameters (`parameter_names`) to transformers' tensors:
/// each stacked expert tensor unstacked into the per-expert ones, the rest unchanged.
[[nodiscard]] state::Mapper qwen3_moe_hf_export_mapper(
    const Qwen3MoeConfig& config, const std::vector<std::string>& parameter_names);

/// Streams the checkpoint in `dir` (model.safetensors, or the shards of
/// model.safetensors.index.json) into `model`'s parameters (std::invalid_argument naming missing,
/// extra and mis-shaped tensors before any read).
void load_hf_qwen3_moe_into(torch::nn::Module& model, const Qwen3MoeConfig& config,
                            const std::string& dir);

/// dir/config.json (Qwen3MoeConfig::from_json_text) and its weights as a new model.
[[nodiscard]] Qwen3MoeForCausalLM load_hf_qwen3_moe(const std::string& dir);

/// Writes `module`'s parameters through `mapper` (model names -> checkpoint names), group by group,
/// into dir/model.safetensors (each tensor in `dtype`), and `config_json` to dir/config.json.
void save_hf_mapped(const torch::nn::Module& module, const state::Mapper& mapper,
                    const std::string& dir, const std::string& config_json,
                    at::ScalarType dtype = at::kFloat);

/// The whole model as transformers' Qwen3MoeForCausalLM checkpoint with its config.json.
void save_hf_qwen3_moe(const Qwen3MoeForCausalLMImpl& model, const std::string& dir,
                       at::ScalarType dtype = at::kFloat);

}  // namespace d9d::model
