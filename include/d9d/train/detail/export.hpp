// d9d/train/detail/export.hpp — the model exports of the two steps (src/train/export.cpp): the
// whole model streamed from every rank, and a pipeline's stages sent to the main rank. Not a
// public API: the steps' export_model (d9d/train/step.hpp) calls them.
#pragma once

#include <memory>
#include <vector>

#include <torch/nn/module.h>

#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/train/step.hpp>

namespace d9d::detail {

/// The whole model as a Hugging Face checkpoint, streamed one parameter group at a time: each
/// input is gathered from its parts when the parallelize layer sharded it (collective, every rank
/// in the same order), mapped by the request's mapper and written by the main rank. With LoRA
/// adapters the checkpoint is the merged model and request.adapter_dir gets the adapters (and the
/// other trained parameters) in peft's format.
ExportResult export_whole_model(const parallel::ParallelModel& parallel,
                                const torch::nn::Module& model, const ExportRequest& request);

/// The whole model from a pipeline's stages, as export_whole_model writes it: each stage's owners
/// map their parameters (the mapper, per stage), the main rank writes every tensor in key order,
/// one mapper group at a time; a tensor an earlier stage wrote (a tied embedding's copy) is
/// written once. With LoRA adapters on any stage the checkpoint is the merged model, and the main
/// rank writes the adapters of every stage as one peft adapter to request.adapter_dir.
ExportResult export_stages(const parallel::ParallelModel& parallel,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& stages,
                           const pipeline::Program& program, const ExportRequest& request);

}  // namespace d9d::detail
