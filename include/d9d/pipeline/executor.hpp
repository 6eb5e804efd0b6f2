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
// (d9d/core/weight_grad.hpp), W drains that queue. Parameter gradients accumulate into .grad as
// in a single-process backward over all microbatches.
//
// Communication: each maximal run of consecutive send/receive actions is posted as one batch
// (d9d::batch_isend_irecv: one NCCL group) when the walk reaches it, so every rank posts its
// batches in program order. With ExecutorOptions::overlap_p2p (the default) a batch is then left
// in flight: it is waited for only when a compute action takes a tensor it receives (a received
// activation or gradient), and every batch still pending is waited for at the end of the step;
// sends are thus waited for at the end of the step (or with a receive of their batch that is
// needed). On NCCL a wait makes the current stream wait for the communication (the host goes on);
// on Gloo it blocks the host. Without overlap each batch is waited for right after it is posted.
// verify() proves that the second way cannot deadlock and that messages between two ranks are
// received in the order they are sent; the first waits for the same batches, posted in the same
// order, only later, so it cannot deadlock either (docs/design/0015). A step that fails leaves
// the batches it had in flight to the backend (their tensors are kept alive) and rethrows.
//
// With ExecutorOptions::overlap_pairs a forward and the backward of another stage that follows it
// run at once (DualPipe's overlap; d9d/pipeline/pairs.hpp).
//
// With record_timeline(true) the executor records when each compute action ran (timeline());
// gather_timeline() collects every rank's, and d9d/pipeline/picture.hpp draws them under the
// program's plan.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/pipeline/verify.hpp>

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

/// How the executor communicates and what it records (aggregate; designated initializers).
struct ExecutorOptions {
  /// Leave each batch of sends and receives in flight until compute takes a tensor it receives,
  /// and wait for the rest at the end of the step (true), or wait for each batch right after
  /// posting it, before the next compute action (false; the model verify() checks).
  bool overlap_p2p = true;
  /// Record when each compute action runs (Executor::timeline()); see also record_timeline().
  bool record_timeline = false;
  /// Run each pair of the program (d9d/pipeline/pairs.hpp: a forward directly followed by a
  /// backward of another stage of this rank, as in DualPipeV's steady state) at once: the backward
  /// on a helper thread, the forward on the caller's. The constructor regroups the program with
  /// group_pairs() and throws std::invalid_argument when the result does not verify(). A pair's
  /// hooks (on_compute) are called as both "before"s, then both "after"s, and its two timeline
  /// slots both span the pair. On CUDA the helper takes the caller's current stream, so the two
  /// overlap on the host (launches) and their kernels interleave on one stream (streams per stage
  /// are not built).
  /// Only for stages that may run from two threads at once: no collectives inside the stages
  /// (tensor or expert parallelism) and no per-action hooks that keep state (FullyShard's
  /// gathers).
  bool overlap_pairs = false;
};

/// Runs a program's actions for this rank (see the file comment).
class Executor {
 public:
  /// Collective over `group` (every pipeline rank constructs its executor together).
  /// `group`: the pipeline group, group rank r = program rank r (may be invalid when pp == 1).
  /// `stages`: exactly the stages the program places on this rank. `activation(s)`: the input of
  /// stage s > 0 for one microbatch (what the previous stage sends), the same on every rank.
  Executor(Program program, ProcessGroup group, std::vector<Stage> stages,
           std::function<TensorSpec(int stage)> activation, ExecutorOptions options = {});
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

  /// Records (true) or stops recording when each compute action runs, from the next run() on.
  void record_timeline(bool on);
  /// The compute actions of the last recorded run() on this rank, in program order, each with its
  /// start and end in seconds since that step began. On the CPU from the steady clock around the
  /// action; on CUDA from events recorded on the current stream around it, resolved here (this
  /// waits for them, not during the step). Waiting for a received tensor lies before the start.
  /// Empty when nothing was recorded.
  [[nodiscard]] std::vector<Timeline::Slot> timeline() const;

  [[nodiscard]] const ExecutorOptions& options() const;
  [[nodiscard]] const Program& program() const;
  [[nodiscard]] int rank() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Every pipeline rank's timeline (e.g. Executor::timeline()), row r from group rank r, on every
/// rank; makespan: the latest end. Collective over `group`; an invalid group (pp == 1) gives `mine`
/// as the only row. Each row is timed from its own rank's step start: run the step after a
/// barrier for rows that line up.
[[nodiscard]] Timeline gather_timeline(const ProcessGroup& group,
                                       const std::vector<Timeline::Slot>& mine);

}  // namespace d9d::pipeline
