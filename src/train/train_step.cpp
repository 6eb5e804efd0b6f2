// d9d/train/train_step.cpp — gradient accumulation, replicate reduction, clipping, AdamW.
#include <any>
#include <chrono>
#include <stdexcept>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/optim/adamw.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/kernels/cuda_graph.hpp>
#include <d9d/optim/adamw.hpp>
#include <d9d/train/detail/export.hpp>
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

void begin_step(torch::optim::Optimizer& optimizer, double lr, bool drop_gradients) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  if (drop_gradients) {
    optimizer.zero_grad(/*set_to_none=*/true);
  }
}

namespace {

// A task's LossOutput has a scalar loss_sum and a weight (`who` names the task's method).
void require_loss_output(const LossOutput& out, const char* who) {
  if (!out.loss_sum.defined() || out.loss_sum.numel() != 1 || !out.weight.defined()) {
    throw std::invalid_argument(std::string("d9d::TrainStep: the task's ") + who +
                                " must return a scalar loss_sum and a weight");
  }
}

}  // namespace

void accumulate_loss(const LossOutput& out, at::Tensor& loss_sum, at::Tensor& weight_sum,
                     const char* who) {
  require_loss_output(out, who);
  // New tensors, never views of `out`: a CUDA graph rewrites its outputs on the next replay (and
  // .to() returns the tensor itself when it already is float64).
  const auto loss_value = out.loss_sum.detach().to(at::kDouble).reshape({});
  const auto weight_value = out.weight.detach().to(loss_value.device(), at::kDouble).sum();
  loss_sum = loss_sum.defined() ? loss_sum + loss_value : loss_value.clone();
  weight_sum = weight_sum.defined() ? weight_sum + weight_value : weight_value;
}

at::Tensor global_totals(const at::Tensor& loss_sum, const at::Tensor& weight_sum,
                         const std::vector<ProcessGroup>& groups, c10::Device device) {
  const auto zero = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  auto totals = at::stack({loss_sum.defined() ? loss_sum.to(device) : zero,
                           weight_sum.defined() ? weight_sum.to(device) : zero});
  for (const auto& group : groups) {
    totals = all_reduce(group, totals);
  }
  return totals;
}

StepResult finish_step(torch::optim::Optimizer& optimizer, const TrainStepOptions& options,
                       int64_t step, double lr, const at::Tensor& totals,
                       parallel::ParallelModel& parallel, const ProcessGroup& world) {
  // Token-mean gradients, their norm over the mesh, clipping: queued behind the backward.
  const auto grad_norm = parallel.normalize_and_clip(totals[1], options.max_grad_norm);
  // The loss and the norm are reduced over the mesh, so ranks normally see the same values; the
  // flag's all-reduce makes the decision one by construction (a rank of another tensor-parallel
  // or pipeline group cannot step while this one skips).
  auto bad =
      at::logical_not(at::isfinite(totals[0] / totals[1]).logical_and(at::isfinite(grad_norm)))
          .to(at::kFloat)
          .reshape({1});
  if (world.size() > 1) {
    bad = all_reduce(world, bad.to(world.device()), ReduceOp::max);
  }
  // The step's one wait for the device: everything above was queued without waiting.
  const auto host = at::cat({totals, grad_norm.reshape({1}).to(totals.device(), at::kDouble),
                             bad.to(totals.device(), at::kDouble)})
                        .cpu();
  const auto* values = host.const_data_ptr<double>();
  const double total_loss = values[0];
  const double total_weight = values[1];
  if (!(total_weight > 0)) {
    throw std::runtime_error("d9d::TrainStep: step " + std::to_string(step) +
                             " has a total loss weight of " + std::to_string(total_weight) +
                             " (no target tokens on any rank?)");
  }
  StepResult result{
      .loss = total_loss / total_weight, .weight = total_weight, .grad_norm = values[2], .lr = lr};
  result.finite = values[3] == 0.0;
  if (!result.finite) {
    return result;  // no optimizer step: the parameters and AdamW's state stay as they were
  }
  if (options.events != nullptr) {
    options.events->emit(events::BeforeOptimizer{.step = step, .grad_norm = result.grad_norm});
  }
  {
    RECORD_USER_SCOPE("d9d::optimizer");
    optimizer.step();
  }
  if (options.events != nullptr) {
    options.events->emit(events::AfterOptimizer{.step = step, .lr = lr});
  }
  return result;
}

struct TrainStepCore::Impl {
  std::unique_ptr<parallel::ParallelModel> parallel;
  std::shared_ptr<torch::nn::Module> model;
  MicrobatchLoss loss;
  TrainStepOptions options;
  std::vector<ProcessGroup> loss_groups;  ///< the strategies' loss dims (dp)
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  optim::PiecewiseSchedule schedule;
  c10::Device device = c10::Device(c10::kCPU);

  // CUDA graphs: the captured microbatch (its tensors are the graphs' inputs) and two graphs of
  // its forward and backward with the loss outputs they recompute on each replay. `first` was
  // captured without gradients, so autograd gave each parameter a gradient from the graph's pool
  // and the replay overwrites it (a step's first microbatch needs no zeroing); `rest` was captured
  // with them, so its replays add into them in place. `gradient_addresses`: where the gradients
  // were at the capture (a step that finds them elsewhere stops with an error).
  std::any captured;
  std::unique_ptr<kernels::MicrobatchGraph> first;
  std::unique_ptr<kernels::MicrobatchGraph> rest;
  LossOutput first_out;
  LossOutput rest_out;
  std::vector<const void*> gradient_addresses;
  bool warned_eager = false;
  int64_t steps_run = 0;

  LossOutput forward(const std::any& microbatch) const {
    RECORD_USER_SCOPE("d9d::forward");
    const AutocastScope autocast(options.bf16_autocast, device.type());
    return loss(microbatch);
  }
  std::unique_ptr<kernels::MicrobatchGraph> capture(LossOutput& out,
                                                    kernels::MicrobatchGraph* share_pool_with);
  [[nodiscard]] std::vector<const void*> gradient_memory() const;
  /// Under CUDA graphs: captures them at the first use and copies `microbatch` into the captured
  /// one; "" when it can replay, else why it runs eagerly.
  std::string graph_for(const std::any& microbatch, int i);
  /// Microbatch i of `count`: replayed (returns true) or run eagerly, its loss added to the sums.
  bool microbatch(const std::any& mb, int i, int count, bool graphs, at::Tensor& loss_sum,
                  at::Tensor& weight_sum);
};

std::vector<const void*> TrainStepCore::Impl::gradient_memory() const {
  std::vector<const void*> out;
  for (const auto& record : parallel->parameters()) {
    out.push_back(record.local.grad().defined() ? record.local.grad().const_data_ptr() : nullptr);
  }
  return out;
}

std::unique_ptr<kernels::MicrobatchGraph> TrainStepCore::Impl::capture(
    LossOutput& out, kernels::MicrobatchGraph* share_pool_with) {
  auto graph = kernels::make_microbatch_graph(device);
  graph->capture(
      [&] {
        out = forward(captured);
        require_loss_output(out, "compute_loss");
        RECORD_USER_SCOPE("d9d::backward");
        out.loss_sum.backward();
      },
      share_pool_with);
  gradient_addresses = gradient_memory();
  return graph;
}

TrainStepCore::TrainStepCore(std::unique_ptr<parallel::ParallelModel> model, MicrobatchLoss loss,
                             TrainStepOptions options,
                             const parallel::StepContributions& contributions)
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
  s.device = s.parallel->mesh().context().device();
  s.loss_groups = contributions.loss_groups(s.parallel->mesh());
  s.optimizer = make_adamw(s.parallel->parameters(), s.options);
  if (s.options.cuda_graphs) {
    if (const auto blocker = s.parallel->graph_blocker(); !blocker.empty()) {
      throw std::invalid_argument(
          "d9d::TrainStep: CUDA graphs replay the kernels of a microbatch, not the host code "
          "around them, but " +
          blocker +
          ". Fix: set \"cuda_graphs\": {\"enabled\": false}, or train on one rank with a plan "
          "whose strategies add no such path (Replicate)");
    }
    if (!s.options.copier.clone || !s.options.copier.copy) {
      throw std::invalid_argument(
          "d9d::TrainStep: CUDA graphs need TrainStepOptions::copier (d9d::microbatch_copier<"
          "Batch>())");
    }
    if (s.options.graph_warmup_steps < 0) {
      throw std::invalid_argument("d9d::TrainStep: graph_warmup_steps must be >= 0");
    }
    (void)kernels::make_microbatch_graph(
        s.device);  // a CUDA device and a CUDA build, or a clear error
  }
}

TrainStepCore::~TrainStepCore() = default;

std::vector<std::shared_ptr<torch::nn::Module>> TrainStepCore::modules() const {
  return {impl_->model};
}
std::shared_ptr<torch::nn::Module> TrainStepCore::whole_model() const { return impl_->model; }
parallel::ParallelModel& TrainStepCore::parallel() { return *impl_->parallel; }
torch::optim::Optimizer& TrainStepCore::optimizer() { return *impl_->optimizer; }
ExportResult TrainStepCore::export_model(const ExportRequest& request) {
  return export_whole_model(*impl_->parallel, *impl_->model, request);
}

void check_whole_model_config(const TrainerConfig& config) {
  if (config.logging.pipeline_timeline_step > 0) {
    throw ConfigError(
        "d9d config: \"logging.pipeline_timeline_step\" draws a pipeline program's timeline, "
        "but the plan has no pipeline schedule. Fix: remove it, or train with a pipeline plan");
  }
}

std::unique_ptr<StepCore> make_whole_model_step(std::unique_ptr<parallel::ParallelModel> model,
                                                MicrobatchLoss loss, TrainStepOptions options,
                                                const parallel::StepContributions& contributions) {
  const bool graphs = options.cuda_graphs;
  try {
    return std::make_unique<TrainStepCore>(std::move(model), std::move(loss), std::move(options),
                                           contributions);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::invalid_argument& e) {
    if (!graphs) {
      throw;
    }
    std::string why = e.what();
    for (const std::string prefix : {"d9d::TrainStep: ", "d9d: "}) {
      if (why.rfind(prefix, 0) == 0) {
        why.erase(0, prefix.size());
      }
    }
    throw ConfigError("d9d config: \"cuda_graphs\": " + why);
  }
}

std::string TrainStepCore::Impl::graph_for(const std::any& microbatch, int i) {
  if (!first) {
    // The capture step: its start dropped the gradients. The graphs' inputs live on the device:
    // the task's copies to the device are no-ops inside them, and each replay's inputs arrive by
    // copy_batch_ before it.
    captured = options.copier.clone(microbatch, device);
    first = capture(first_out, nullptr);
  }
  auto difference = options.copier.copy(captured, microbatch);
  if (difference.empty() && i > 0 && !rest) {
    rest = capture(rest_out, first.get());  // one memory pool: replays never overlap
  }
  if (!difference.empty() && !warned_eager) {
    warned_eager = true;
    parallel->mesh().context().logger().warning(
        "CUDA graphs: a microbatch differs from the captured one (" + difference +
        "); such microbatches run eagerly (said once)");
  }
  return difference;
}

bool TrainStepCore::Impl::microbatch(const std::any& mb, int i, int count, bool graphs,
                                     at::Tensor& loss_sum, at::Tensor& weight_sum) {
  if (graphs && graph_for(mb, i).empty()) {
    const LossOutput& out = i == 0 ? first_out : rest_out;
    parallel->before_forward(i, count);
    parallel->before_backward(i, count);
    {
      RECORD_USER_SCOPE("d9d::graph_replay");
      (i == 0 ? first : rest)->replay();
    }
    accumulate_loss(out, loss_sum, weight_sum, "compute_loss");
    if (options.after_microbatch) {
      options.after_microbatch(out, captured);
    }
    return true;
  }
  if (i == 0 && first) {
    // An eager first microbatch: the gradients still hold the last step's (kept for the graphs;
    // the optimizer's parameters are the records' tensors).
    optimizer->zero_grad(/*set_to_none=*/false);
  }
  parallel->before_forward(i, count);
  LossOutput out = forward(mb);
  accumulate_loss(out, loss_sum, weight_sum, "compute_loss");
  parallel->before_backward(i, count);
  {
    RECORD_USER_SCOPE("d9d::backward");
    out.loss_sum.backward();
  }
  if (options.after_microbatch) {
    options.after_microbatch(out, mb);
  }
  return false;
}

StepResult TrainStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  if (microbatches.empty()) {
    throw std::invalid_argument("d9d::TrainStep::run: no microbatches");
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  // Warm-up counts the steps this object ran (a resumed run warms up too).
  const bool graphs = s.options.cuda_graphs && s.steps_run++ >= s.options.graph_warmup_steps;
  // Once captured, the graphs own the gradients' memory: the step keeps them (the first
  // microbatch's replay overwrites them).
  begin_step(*s.optimizer, lr, /*drop_gradients=*/!s.first);
  if (s.first && s.gradient_memory() != s.gradient_addresses) {
    throw std::logic_error(
        "d9d::TrainStep: a parameter's gradient moved to other memory after the CUDA graph was "
        "captured (something replaced .grad); the graph would accumulate into the old memory");
  }
  s.parallel->begin_step();

  // An eager step on a CUDA device: the step's microbatches on the device before the first
  // forward, through pinned memory without waiting for the device (TrainStepOptions::copier, as
  // the pipelined step does). The task's own copy inside each forward waited for everything
  // queued before it: the device drained at every microbatch (8 synchronisations a step at 8
  // microbatches; docs/measurements/2026-11-29-plain-step-microbatches-on-device-1xh200.txt).
  // Graph replays copy into the captured microbatch instead.
  std::vector<std::any> on_device;
  if (!graphs && s.device.is_cuda() && s.options.copier.clone) {
    RECORD_USER_SCOPE("d9d::microbatches_to_device");
    on_device.reserve(microbatches.size());
    for (const auto& microbatch : microbatches) {
      on_device.push_back(s.options.copier.clone(microbatch, s.device));
    }
  }
  const auto& batches = on_device.empty() ? microbatches : on_device;

  // Sums stay on the loss's device (no synchronisation per microbatch).
  at::Tensor loss_sum;
  at::Tensor weight_sum;
  const int count = static_cast<int>(microbatches.size());
  int replayed = 0;
  const auto issue_start = std::chrono::steady_clock::now();
  {
    // Bf16 mixed over several microbatches: each weight cast once for the step (eager steps only:
    // a replayed graph recasts inside its kernels).
    const WeightCastScope casts(s.options.bf16_autocast && count > 1 && !graphs);
    for (int i = 0; i < count; ++i) {
      replayed +=
          s.microbatch(batches[static_cast<std::size_t>(i)], i, count, graphs, loss_sum, weight_sum)
              ? 1
              : 0;
    }
  }
  const double issue_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - issue_start).count();
  {
    RECORD_USER_SCOPE("d9d::gradient_sync");
    s.parallel->finish();
  }

  const auto totals = global_totals(loss_sum, weight_sum, s.loss_groups, loss_sum.device());
  auto result = finish_step(*s.optimizer, s.options, step, lr, totals, *s.parallel,
                            s.parallel->mesh().context().world());
  result.issue_seconds = issue_seconds;
  result.replayed_microbatches = replayed;
  return result;
}

}  // namespace detail
}  // namespace d9d
