// d9d/train/train_step.cpp — gradient accumulation, replicate reduction, clipping, AdamW.
#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/optim/adamw.hpp>
#include <d9d/train/detail/step_parts.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {
namespace detail {

std::unique_ptr<torch::optim::Optimizer> make_adamw(
    const std::vector<parallel::ParameterRecord>& params, const TrainStepOptions& options) {
  const OptimizerConfig& config = options.optimizer;
  std::vector<at::Tensor> decay;
  std::vector<at::Tensor> no_decay;
  for (const auto& param : params) {
    (param.decays() ? decay : no_decay).push_back(param.local);
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
  if (options.stochastic_rounding) {
    return std::make_unique<optim::StochasticAdamW>(
        std::move(groups), adamw,
        optim::StochasticOptions{.seed = options.seed,
                                 .state_dtype = options.optimizer_state == at::ScalarType::Undefined
                                                    ? at::kFloat
                                                    : options.optimizer_state});
  }
  return std::make_unique<optim::FusedAdamW>(std::move(groups), adamw);
}

void begin_step(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  optimizer.zero_grad(/*set_to_none=*/true);
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

StepResult finish_step(torch::optim::Optimizer& optimizer, const TrainStepOptions& options,
                       int64_t step, double lr, std::pair<double, double> totals,
                       double grad_norm) {
  if (options.events != nullptr) {
    options.events->emit(events::BeforeOptimizer{.step = step, .grad_norm = grad_norm});
  }
  {
    RECORD_USER_SCOPE("d9d::optimizer");
    optimizer.step();
  }
  if (options.events != nullptr) {
    options.events->emit(events::AfterOptimizer{.step = step, .lr = lr});
  }
  return {.loss = totals.first / totals.second,
          .weight = totals.second,
          .grad_norm = grad_norm,
          .lr = lr};
}

struct TrainStepCore::Impl {
  std::unique_ptr<parallel::ParallelModel> parallel;
  std::shared_ptr<torch::nn::Module> model;
  MicrobatchLoss loss;
  TrainStepOptions options;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  optim::PiecewiseSchedule schedule;
  c10::DeviceType device_type = c10::kCPU;
};

TrainStepCore::TrainStepCore(std::unique_ptr<parallel::ParallelModel> model, MicrobatchLoss loss,
                             TrainStepOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.parallel = std::move(model);
  if (s.parallel->modules().size() != 1) {
    throw std::invalid_argument("d9d::TrainStep: the step runs one module (the whole model), got " +
                                std::to_string(s.parallel->modules().size()));
  }
  s.model = s.parallel->modules().front();
  s.loss = std::move(loss);
  s.options = std::move(options);
  s.schedule = optim::PiecewiseSchedule::build(s.options.lr_schedule, s.options.total_steps);
  s.device_type = s.parallel->mesh().context().device().type();
  s.optimizer = make_adamw(s.parallel->parameters(), s.options);
}

TrainStepCore::~TrainStepCore() = default;

const std::shared_ptr<torch::nn::Module>& TrainStepCore::model() const { return impl_->model; }
parallel::ParallelModel& TrainStepCore::parallel() { return *impl_->parallel; }
torch::optim::Optimizer& TrainStepCore::optimizer() { return *impl_->optimizer; }

StepResult TrainStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  if (microbatches.empty()) {
    throw std::invalid_argument("d9d::TrainStep::run: no microbatches");
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  begin_step(*s.optimizer, lr);
  s.parallel->begin_step();

  // Sums stay on the loss's device (no synchronisation per microbatch).
  at::Tensor loss_sum;
  at::Tensor weight_sum;
  const int count = static_cast<int>(microbatches.size());
  for (int i = 0; i < count; ++i) {
    LossOutput out;
    {
      RECORD_USER_SCOPE("d9d::forward");
      const AutocastScope autocast(s.options.bf16_autocast, s.device_type);
      out = s.loss(microbatches[static_cast<std::size_t>(i)]);
    }
    accumulate_loss(out, loss_sum, weight_sum, "compute_loss");
    s.parallel->before_backward(i, count);
    {
      RECORD_USER_SCOPE("d9d::backward");
      out.loss_sum.backward();
    }
  }
  {
    RECORD_USER_SCOPE("d9d::gradient_sync");
    s.parallel->finish();
  }

  const auto dp = s.parallel->mesh().group(MeshDomain::batch, "dp");
  const auto totals = global_totals(loss_sum, weight_sum, {&dp}, loss_sum.device(), step);
  // Token-mean gradients, their norm over the mesh, clipping.
  const double grad_norm = s.parallel->normalize_and_clip(totals.second, s.options.max_grad_norm);
  return finish_step(*s.optimizer, s.options, step, lr, totals, grad_norm);
}

}  // namespace detail
}  // namespace d9d
