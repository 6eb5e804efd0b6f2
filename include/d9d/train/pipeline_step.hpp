// d9d/train/pipeline_step.hpp — one rank's optimizer step when the Plan has a pipeline schedule.
//
// Trainer<Plan> composes it when Plan::pipeline is a schedule (d9d/pipeline/schedules.hpp): each
// rank holds the stages the program places on it (built by the model provider's build_stage),
// and a step runs the program through d9d::pipeline::Executor — the first stage reads the task's
// stage_input of each microbatch, the last stage calls the task's output_loss. Then, as in
// TrainStep: gradients are reduced over the data-parallel ranks (after the program), divided by the
// step's global loss weight (the loss is the token mean over every microbatch of every
// data-parallel rank), the gradient norm is summed over the pipeline ranks and clipped, and AdamW
// updates this rank's parameters. The gradient path is the parallelize layer's (built with
// ParallelizeOptions::pipelined: weight gradients may come from W actions, so strategies reduce
// after the program); its last part sums the gradients of a parameter tied across stages (a tied
// embedding's two holders) over the ranks that hold it. Losses and gradients equal a
// single-process step over the same global batch (tests/train: Trainer_Pipeline_Gloo,
// Trainer_PipelineTied_Gloo).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/train_step.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d::detail {

/// The pieces of a pipelined run, type-erased (the trainer fills them from the user's types).
struct PipelineParts {
  pipeline::Program program;
  /// This rank's stages, in increasing stage order: the module and its forward.
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>> stages;
  /// The input of stage s > 0 for one microbatch (what the previous stage sends).
  std::function<pipeline::TensorSpec(int stage)> activation;
  /// The first stage's input of a microbatch (the task's stage_input).
  std::function<at::Tensor(const std::any& microbatch)> input;
  /// The loss of the last stage's output (the task's output_loss).
  std::function<LossOutput(const at::Tensor& output, const std::any& microbatch)> loss;
};

class PipelineStepCore {
 public:
  /// Collective over the mesh (every rank constructs it together). `model`: the parallelize
  /// layer's result for this rank's stage modules (those of `parts`, in the same order).
  PipelineStepCore(std::unique_ptr<parallel::ParallelModel> model, PipelineParts parts,
                   TrainStepOptions options);
  ~PipelineStepCore();
  PipelineStepCore(const PipelineStepCore&) = delete;
  PipelineStepCore& operator=(const PipelineStepCore&) = delete;
  PipelineStepCore(PipelineStepCore&&) = delete;
  PipelineStepCore& operator=(PipelineStepCore&&) = delete;

  /// One optimizer step over this pipeline's microbatches (exactly program.microbatches of them;
  /// collective over the pp and dp groups).
  StepResult run(const std::vector<std::any>& microbatches, int64_t step);
  /// This rank's stage modules.
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> stages() const;
  [[nodiscard]] const pipeline::Program& program() const;
  /// The parallelize layer's result (parameter records of this rank's stages).
  [[nodiscard]] parallel::ParallelModel& parallel();
  /// The optimizer (AdamW) over this rank's trained parameters.
  [[nodiscard]] torch::optim::Optimizer& optimizer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace d9d::detail
