// d9d/train/detail/step_parts.hpp — what the data-parallel step (TrainStep) and the pipeline step
// share: the optimizer set-up, the loss sums, the token-mean gradients with their global norm and
// clipping, and the step's tail (events, optimizer step). Not a public API.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>
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

/// AdamW over `params`: weight decay on matrices (dim >= 2), none on the rest.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const std::vector<at::Tensor>& params,
                                                    const OptimizerConfig& config);

/// The start of a step: sets the learning rate of every parameter group (AdamW options) and drops
/// the previous step's gradients.
void begin_step(torch::optim::Optimizer& optimizer, double lr);

/// Copies rank 0's value of every parameter over `group` (replicas start alike).
void broadcast_parameters(const ProcessGroup& group, const std::vector<at::Tensor>& params);

/// Checks a task's LossOutput (`who` names the task method in the error) and adds it to the
/// running sums (double, on the loss's device; no synchronisation).
void accumulate_loss(const LossOutput& out, at::Tensor& loss_sum, at::Tensor& weight_sum,
                     const char* who);

/// The step's global totals: {loss_sum, weight_sum} summed over each group in `groups` (an
/// undefined sum counts as 0 on `device`); throws when the total weight is not positive.
std::pair<double, double> global_totals(const at::Tensor& loss_sum, const at::Tensor& weight_sum,
                                        const std::vector<const ProcessGroup*>& groups,
                                        c10::Device device, int64_t step);

/// Divides the gradients of `params` by `total_weight`, computes their global 2-norm (squares
/// summed over `norm_group` too when given: parameters split over its ranks), clips to
/// `max_norm` and returns the norm before clipping.
double normalize_and_clip(const std::vector<at::Tensor>& params, double total_weight,
                          std::optional<double> max_norm, const ProcessGroup* norm_group);

/// Events around the optimizer step, the step itself, and the result.
StepResult finish_step(torch::optim::Optimizer& optimizer, const TrainStepOptions& options,
                       int64_t step, double lr, std::pair<double, double> totals, double grad_norm);

}  // namespace d9d::detail
