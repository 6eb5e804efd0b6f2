// d9d/train/train_step.cpp — gradient accumulation, replicate reduction, clipping, AdamW.
#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/parallel/replicate.hpp>
#include <d9d/train/detail/autocast_scope.hpp>
#include <d9d/train/detail/step_parts.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {
namespace detail {

std::unique_ptr<torch::optim::Optimizer> make_adamw(const std::vector<at::Tensor>& params,
                                                    const OptimizerConfig& config) {
  std::vector<at::Tensor> decay;
  std::vector<at::Tensor> no_decay;
  for (const auto& param : params) {
    (param.dim() >= 2 ? decay : no_decay).push_back(param);
  }
  auto adamw =
      torch::optim::AdamWOptions(config.lr).betas({config.beta1, config.beta2}).eps(config.eps);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) {
    groups.emplace_back(decay,
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(adamw).weight_decay(config.weight_decay)));
  }
  if (!no_decay.empty()) {
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  }
  return std::make_unique<torch::optim::AdamW>(std::move(groups), adamw);
}

void begin_step(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  optimizer.zero_grad(/*set_to_none=*/true);
}

void broadcast_parameters(const ProcessGroup& group, const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  for (const auto& param : params) {
    at::Tensor(param).copy_(broadcast(group, param.detach(), 0));
  }
}

void accumulate_loss(const LossOutput& out, at::Tensor& loss_sum, at::Tensor& weight_sum,
                     const char* who) {
  if (!out.loss_sum.defined() || out.loss_sum.numel() != 1 || !out.weight.defined()) {
    throw std::invalid_argument(std::string("d9d::TrainStep: the task's ") + who +
                                " must return a scalar loss_sum and a weight");
  }
  const auto loss_value = out.loss_sum.detach().to(at::kDouble).reshape({});
  const auto weight_value = out.weight.detach().to(loss_value.device(), at::kDouble).sum();
  loss_sum = loss_sum.defined() ? loss_sum + loss_value : loss_value;
  weight_sum = weight_sum.defined() ? weight_sum + weight_value : weight_value;
}

std::pair<double, double> global_totals(const at::Tensor& loss_sum, const at::Tensor& weight_sum,
                                        const std::vector<const ProcessGroup*>& groups,
                                        c10::Device device, int64_t step) {
  const auto zero = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  auto totals = at::stack({loss_sum.defined() ? loss_sum.to(device) : zero,
                           weight_sum.defined() ? weight_sum.to(device) : zero});
  for (const auto* group : groups) {
    totals = all_reduce(*group, totals);
  }
  totals = totals.cpu();
  const double total_loss = totals[0].item<double>();
  const double total_weight = totals[1].item<double>();
  if (!(total_weight > 0)) {
    throw std::runtime_error("d9d::TrainStep: step " + std::to_string(step) +
                             " has a total loss weight of " + std::to_string(total_weight) +
                             " (no target tokens on any rank?)");
  }
  return {total_loss, total_weight};
}

double normalize_and_clip(const std::vector<at::Tensor>& params, double total_weight,
                          std::optional<double> max_norm, const ProcessGroup* norm_group) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& param : params) {
    if (param.grad().defined()) {
      grads.push_back(at::Tensor(param).mutable_grad());
    }
  }
  const at::NoGradGuard no_grad;
  at::Tensor squares;
  if (!grads.empty()) {
    at::_foreach_div_(grads, at::Scalar(total_weight));
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& grad : grads) {
      norms.push_back(at::linalg_vector_norm(grad, 2, std::nullopt, false, at::kFloat));
    }
    squares = at::stack(norms).to(at::kDouble).pow(2).sum();
  }
  if (norm_group != nullptr) {
    const auto device = norm_group->device();
    squares = all_reduce(
        *norm_group, squares.defined()
                         ? squares.to(device)
                         : at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device)));
  }
  const double grad_norm = squares.defined() ? std::sqrt(squares.item<double>()) : 0.0;
  if (!grads.empty() && max_norm && grad_norm > *max_norm) {
    at::_foreach_mul_(grads, at::Scalar(*max_norm / (grad_norm + 1e-6)));
  }
  return grad_norm;
}

StepResult finish_step(torch::optim::Optimizer& optimizer, const TrainStepOptions& options,
                       int64_t step, double lr, std::pair<double, double> totals,
                       double grad_norm) {
  if (options.events != nullptr) {
    options.events->emit(events::BeforeOptimizer{.step = step, .grad_norm = grad_norm});
  }
  optimizer.step();
  if (options.events != nullptr) {
    options.events->emit(events::AfterOptimizer{.step = step, .lr = lr});
  }
  return {.loss = totals.first / totals.second,
          .weight = totals.second,
          .grad_norm = grad_norm,
          .lr = lr};
}

void check_replicate_mesh(const MeshShape& shape) {
  if (shape.pp != 1 || shape.tp != 1 || shape.cp_replicate != 1 || shape.cp_shard != 1 ||
      shape.ep != 1) {
    throw std::invalid_argument(
        "d9d::TrainStep: with d9d::parallel::Replicate only data-parallel degrees may exceed 1; "
        "the mesh is " +
        shape.describe() + ". Fix: set pp, tp, cp_replicate, cp_shard and ep to 1");
  }
}

struct TrainStepCore::Impl {
  std::shared_ptr<torch::nn::Module> model;
  MicrobatchLoss loss;
  TrainStepOptions options;
  ProcessGroup dp;
  std::vector<at::Tensor> parameters;
  std::unique_ptr<parallel::GradientReducer> reducer;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  optim::PiecewiseSchedule schedule;
  c10::DeviceType device_type = c10::kCPU;
};

TrainStepCore::TrainStepCore(const DeviceMesh& mesh, std::shared_ptr<torch::nn::Module> model,
                             MicrobatchLoss loss, TrainStepOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.model = std::move(model);
  s.loss = std::move(loss);
  s.options = std::move(options);
  s.dp = mesh.group(MeshDomain::batch, "dp");
  s.schedule = optim::PiecewiseSchedule::build(s.options.lr_schedule, s.options.total_steps);
  s.device_type = mesh.context().device().type();
  s.model->train();

  for (const auto& param : s.model->parameters()) {
    if (param.requires_grad()) {
      s.parameters.push_back(param);
    }
  }
  // Replicas start from rank 0's parameters, whatever each rank's initialisation did.
  broadcast_parameters(s.dp, s.parameters);
  s.reducer = std::make_unique<parallel::GradientReducer>(
      s.dp, s.parameters, parallel::GradientReducerOptions{.bucket_bytes = s.options.bucket_bytes});
  s.optimizer = make_adamw(s.parameters, s.options.optimizer);
}

TrainStepCore::~TrainStepCore() = default;

const std::shared_ptr<torch::nn::Module>& TrainStepCore::model() const { return impl_->model; }
const ProcessGroup& TrainStepCore::dp_group() const { return impl_->dp; }
torch::optim::Optimizer& TrainStepCore::optimizer() { return *impl_->optimizer; }

StepResult TrainStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  if (microbatches.empty()) {
    throw std::invalid_argument("d9d::TrainStep::run: no microbatches");
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  begin_step(*s.optimizer, lr);

  // Sums stay on the loss's device (no synchronisation per microbatch).
  at::Tensor loss_sum;
  at::Tensor weight_sum;
  for (std::size_t i = 0; i < microbatches.size(); ++i) {
    if (i + 1 == microbatches.size()) {
      s.reducer->arm();
    }
    LossOutput out;
    {
      const AutocastScope autocast(s.options.bf16_autocast, s.device_type);
      out = s.loss(microbatches[i]);
    }
    accumulate_loss(out, loss_sum, weight_sum, "compute_loss");
    out.loss_sum.backward();
  }
  s.reducer->finish();

  const auto totals = global_totals(loss_sum, weight_sum, {&s.dp}, loss_sum.device(), step);
  // Token-mean gradients, their global norm (replicas hold identical gradients), clipping.
  const double grad_norm =
      normalize_and_clip(s.parameters, totals.second, s.options.max_grad_norm, nullptr);
  return finish_step(*s.optimizer, s.options, step, lr, totals, grad_norm);
}

}  // namespace detail
}  // namespace d9d
