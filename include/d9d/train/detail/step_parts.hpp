// d9d/train/detail/step_parts.hpp — what the data-parallel step (TrainStep) and the pipeline step
// share besides the parallelize layer's result: the optimizer set-up, the loss sums and the step's
// tail (events, optimizer step). Not a public API.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d {
struct StepResult;
struct TrainStepOptions;
}  // namespace d9d

namespace d9d::detail {

/// AdamW over the records' local tensors, weight decay on matrices (the whole parameter has
/// dim >= 2), none on the rest: the fused multi-tensor kernel (optim::FusedAdamW), or
/// optim::StochasticAdamW when the plan's precision rounds stochastically (d9d/optim/adamw.hpp).
std::unique_ptr<torch::optim::Optimizer> make_adamw(
    const std::vector<parallel::ParameterRecord>& params, const TrainStepOptions& options);

/// The start of a step: sets the learning rate of every parameter group (AdamW options) and drops
/// the previous step's gradients (unless `drop_gradients` is false: CUDA graphs own their memory).
void begin_step(torch::optim::Optimizer& optimizer, double lr, bool drop_gradients = true);

/// Checks a task's LossOutput (`who` names the task method in the error) and adds it to the
/// running sums (double, on the loss's device; no synchronisation).
void accumulate_loss(const LossOutput& out, at::Tensor& loss_sum, at::Tensor& weight_sum,
                     const char* who);

/// The step's global totals on `device`: [loss_sum, weight_sum] (float64) summed over each group
/// in `groups` (an undefined sum counts as 0); no synchronisation.
at::Tensor global_totals(const at::Tensor& loss_sum, const at::Tensor& weight_sum,
                         const std::vector<ProcessGroup>& groups, c10::Device device);

/// The step's tail: the gradients divided by the total weight, their norm and clipping
/// (ParallelModel::normalize_and_clip, on the device), whether the loss and the norm are finite on
/// every rank of `world` (one all-reduce of a flag), then the step's one wait for the device (the
/// totals, the norm and the flag read together); throws when the total weight is not positive.
/// Then the events around the optimizer step, the step itself (skipped on every rank when some
/// rank's loss or norm is not finite: the result says `finite = false`), and the result.
StepResult finish_step(torch::optim::Optimizer& optimizer, const TrainStepOptions& options,
                       int64_t step, double lr, const at::Tensor& totals,
                       parallel::ParallelModel& parallel, const ProcessGroup& world);

}  // namespace d9d::detail
