// d9d/pipeline/executor.hpp — runs a pipeline program on one rank over LibTorch stage modules.
//
//   auto program = d9d::pipeline::build_program<d9d::pipeline::ZeroBubbleH1<>>(pp, m);
//   d9d::pipeline::Executor executor(program, mesh.group(d9d::MeshDomain::regular, "pp"),
//                                    {{.index = s, .forward = [&](const at::Tensor& x) {
//                                        return stage(x); }}},
//                                    [&](int stage) { return TensorSpec{...}; });
//   auto result = executor.run(microbatch_inputs, [&](const at::Tensor& logits, int mb) {
//     return loss_of(logits, labels[mb]);             // on the last stage; weighted per microbatch
//   });
//   result.losses;                                     // per microbatch, on the last stage's rank
//
// The executor walks this rank's actions in order (the "VM"): F runs a stage's forward (stage 0
// reads the caller's microbatch, other stages the activation received or handed over locally by
// the previous stage on this rank), B runs the full backward from the loss or from the gradient of
// the stage's output, I runs it with the weight gradients of d9d::model::Linear layers queued
// (d9d/model/weight_grad.hpp), W drains that queue. Each maximal run of consecutive send/receive
// actions is posted as one batch (d9d::batch_isend_irecv: one NCCL group) and waited for before
// the next compute step; verify() proves that this cannot deadlock and that messages between two
// ranks are received in the order they are sent. Parameter gradients accumulate into .grad as in
// a single-process backward over all microbatches.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>
#include <d9d/pipeline/program.hpp>

namespace d9d::pipeline {

/// Shape and dtype of a tensor that crosses a stage boundary.
struct TensorSpec {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};

/// One stage held by this rank.
struct Stage {
  int index = 0;                                         ///< the stage number in the program
  std::function<at::Tensor(const at::Tensor&)> forward;  ///< the stage's module
};

/// The loss of a microbatch from the last stage's output: the scalar backward starts from. Weight
/// it so that the sum over microbatches is the step's loss (e.g. summed token losses divided by
/// the step's token count).
using LossFn = std::function<at::Tensor(const at::Tensor& output, int microbatch)>;

/// What one step produced on this rank.
struct StepResult {
  std::vector<at::Tensor> losses;   ///< per microbatch (detached), where the last stage lives
  std::vector<at::Tensor> outputs;  ///< inference: the last stage's outputs per microbatch
};

/// Runs a program's actions for this rank (see the file comment).
class Executor {
 public:
  /// Collective over `group` (every pipeline rank constructs its executor together).
  /// `group`: the pipeline group, group rank r = program rank r (may be invalid when pp == 1).
  /// `stages`: exactly the stages the program places on this rank. `activation(s)`: the input of
  /// stage s > 0 for one microbatch (what the previous stage sends), the same on every rank.
  Executor(Program program, ProcessGroup group, std::vector<Stage> stages,
           std::function<TensorSpec(int stage)> activation);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  Executor(Executor&&) noexcept;
  Executor& operator=(Executor&&) noexcept;
  ~Executor();

  /// One step. `inputs[mb]`: the first stage's input of microbatch mb (read where this rank holds
  /// stage 0; may be empty elsewhere). `loss` is called on the last stage (ignored in inference).
  StepResult run(const std::vector<at::Tensor>& inputs, const LossFn& loss);

  /// Calls `hook(action, false)` before and `hook(action, true)` after each compute action (e.g.
  /// to time them, as bench/pipeline_bench does); an empty function removes it.
  void on_compute(std::function<void(const Action& action, bool done)> hook);

  [[nodiscard]] const Program& program() const;
  [[nodiscard]] int rank() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace d9d::pipeline
