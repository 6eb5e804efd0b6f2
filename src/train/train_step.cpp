// d9d/train/train_step.cpp — gradient accumulation, replicate reduction, clipping, AdamW.
#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/parallel/replicate.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {
namespace detail {
namespace {

// Enables bf16 autocast for one device type while alive.
class AutocastScope {
 public:
  AutocastScope(bool enabled, c10::DeviceType device) : enabled_(enabled), device_(device) {
    if (enabled_) {
      previous_ = at::autocast::is_autocast_enabled(device_);
      previous_dtype_ = at::autocast::get_autocast_dtype(device_);
      at::autocast::set_autocast_dtype(device_, at::kBFloat16);
      at::autocast::set_autocast_enabled(device_, true);
      at::autocast::increment_nesting();
    }
  }
  ~AutocastScope() {
    if (enabled_) {
      if (at::autocast::decrement_nesting() == 0) {
        at::autocast::clear_cache();
      }
      at::autocast::set_autocast_enabled(device_, previous_);
      at::autocast::set_autocast_dtype(device_, previous_dtype_);
    }
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  AutocastScope(AutocastScope&&) = delete;
  AutocastScope& operator=(AutocastScope&&) = delete;

 private:
  bool enabled_;
  c10::DeviceType device_;
  bool previous_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace

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
  std::unique_ptr<torch::optim::AdamW> optimizer;
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

  std::vector<at::Tensor> decay;
  std::vector<at::Tensor> no_decay;
  for (const auto& param : s.model->parameters()) {
    if (!param.requires_grad()) {
      continue;
    }
    s.parameters.push_back(param);
    (param.dim() >= 2 ? decay : no_decay).push_back(param);
  }
  // Replicas start from rank 0's parameters, whatever each rank's initialisation did.
  {
    const at::NoGradGuard no_grad;
    for (auto& param : s.parameters) {
      param.copy_(broadcast(s.dp, param.detach(), 0));
    }
  }
  s.reducer = std::make_unique<parallel::GradientReducer>(
      s.dp, s.parameters, parallel::GradientReducerOptions{.bucket_bytes = s.options.bucket_bytes});

  const auto& o = s.options.optimizer;
  auto adamw = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) {
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(adamw).weight_decay(o.weight_decay)));
  }
  if (!no_decay.empty()) {
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  }
  s.optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups), adamw);
}

TrainStepCore::~TrainStepCore() = default;

const std::shared_ptr<torch::nn::Module>& TrainStepCore::model() const { return impl_->model; }
const ProcessGroup& TrainStepCore::dp_group() const { return impl_->dp; }

StepResult TrainStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  if (microbatches.empty()) {
    throw std::invalid_argument("d9d::TrainStep::run: no microbatches");
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  for (auto& group : s.optimizer->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  s.optimizer->zero_grad(/*set_to_none=*/true);

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
    if (!out.loss_sum.defined() || out.loss_sum.numel() != 1 || !out.weight.defined()) {
      throw std::invalid_argument(
          "d9d::TrainStep: the task's compute_loss must return a scalar loss_sum and a weight");
    }
    out.loss_sum.backward();
    const auto loss_value = out.loss_sum.detach().to(at::kDouble).reshape({});
    const auto weight_value = out.weight.detach().to(loss_value.device(), at::kDouble).sum();
    loss_sum = loss_sum.defined() ? loss_sum + loss_value : loss_value;
    weight_sum = weight_sum.defined() ? weight_sum + weight_value : weight_value;
  }
  s.reducer->finish();

  const auto totals = all_reduce(s.dp, at::stack({loss_sum, weight_sum})).cpu();
  const double total_loss = totals[0].item<double>();
  const double total_weight = totals[1].item<double>();
  if (!(total_weight > 0)) {
    throw std::runtime_error("d9d::TrainStep: step " + std::to_string(step) +
                             " has a total loss weight of " + std::to_string(total_weight) +
                             " (no target tokens on any rank?)");
  }

  // Token-mean gradients, their global norm (replicas hold identical gradients), clipping.
  std::vector<at::Tensor> grads;
  grads.reserve(s.parameters.size());
  for (auto& param : s.parameters) {
    if (param.grad().defined()) {
      grads.push_back(param.mutable_grad());
    }
  }
  double grad_norm = 0.0;
  if (!grads.empty()) {
    const at::NoGradGuard no_grad;
    at::_foreach_div_(grads, at::Scalar(total_weight));
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& grad : grads) {
      norms.push_back(at::linalg_vector_norm(grad, 2, std::nullopt, false, at::kFloat));
    }
    grad_norm = at::stack(norms).pow(2).sum().sqrt().item<double>();
    if (s.options.max_grad_norm && grad_norm > *s.options.max_grad_norm) {
      at::_foreach_mul_(grads, at::Scalar(*s.options.max_grad_norm / (grad_norm + 1e-6)));
    }
  }

  if (s.options.events != nullptr) {
    s.options.events->emit(events::BeforeOptimizer{.step = step, .grad_norm = grad_norm});
  }
  s.optimizer->step();
  if (s.options.events != nullptr) {
    s.options.events->emit(events::AfterOptimizer{.step = step, .lr = lr});
  }
  return {
      .loss = total_loss / total_weight, .weight = total_weight, .grad_norm = grad_norm, .lr = lr};
}

}  // namespace detail
}  // namespace d9d
