// d9d/train/pipeline_step.cpp — the pipelined optimizer step: program, dp reduction, clipping.
#include <algorithm>
#include <any>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/pipeline/picture.hpp>
#include <d9d/track/svg.hpp>
#include <d9d/train/detail/export.hpp>
#include <d9d/train/detail/step_parts.hpp>
#include <d9d/train/pipeline_step.hpp>

namespace d9d::detail {

std::vector<std::shared_ptr<torch::nn::Module>> RankStages::list() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  out.reserve(stages.size());
  for (const auto& item : stages) {
    out.push_back(item.first);
  }
  return out;
}

void require_sequence_length(const TrainerConfig& config) {
  if (config.batch.sequence_length < 1) {
    throw ConfigError(
        "d9d config: \"batch.sequence_length\" is not given, but a pipeline plan sizes the "
        "tensors between stages with it. Fix: set \"batch\": {\"sequence_length\": N, ...}");
  }
}

void check_pipeline_config(const TrainerConfig& config) {
  if (config.cuda_graphs.enabled) {
    throw ConfigError(
        "d9d config: \"cuda_graphs\" captures the microbatches of a step without a pipeline "
        "schedule; a pipeline program interleaves stages, sends and receives on the host. Fix: "
        "set \"cuda_graphs\": {\"enabled\": false}, or train without a pipeline schedule");
  }
}

std::shared_ptr<pipeline::Executor> make_forward_executor(const DeviceMesh& mesh,
                                                          const RankStages& stages) {
  // Activations cross stages in the dtype of the stages' parameters, as in training.
  const at::ScalarType dtype = stage_activation_dtype(stages.stages);
  std::vector<pipeline::Stage> handles;
  handles.reserve(stages.stages.size());
  for (const auto& item : stages.stages) {
    handles.push_back(item.second);
  }
  return std::make_shared<pipeline::Executor>(stages.program, mesh.group(MeshDomain::regular, "pp"),
                                              std::move(handles),
                                              [activation = stages.activation, dtype](int stage) {
                                                auto spec = activation(stage);
                                                spec.dtype = dtype;
                                                return spec;
                                              });
}

at::ScalarType stage_activation_dtype(
    const std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>>& stages) {
  at::ScalarType dtype = at::kFloat;
  for (const auto& [module, stage] : stages) {
    for (const auto& param : module->parameters()) {
      if (at::isFloatingType(param.scalar_type())) {
        dtype = param.scalar_type();
        break;
      }
    }
  }
  return dtype;
}

struct PipelineStepCore::Impl {
  std::unique_ptr<parallel::ParallelModel> parallel;
  PipelineParts parts;
  TrainStepOptions options;
  ProcessGroup pp;
  /// The loss totals' groups: pp (only the last stage's ranks hold loss sums), then the
  /// strategies' loss dims (dp).
  std::vector<ProcessGroup> loss_groups;
  std::unique_ptr<pipeline::Executor> executor;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  optim::PiecewiseSchedule schedule;
  c10::Device device = c10::Device(c10::kCPU);
  bool holds_first = false;
  /// This rank runs the program's last stage (its loss reads each microbatch's targets).
  bool holds_last = false;
};

namespace {

// The executor of the program over this rank's stages, each forward under the plan's precision
// (its backward follows autograd's record); activations cross stages in the dtype of the
// modules' parameters (stage_activation_dtype).
std::unique_ptr<pipeline::Executor> make_executor(const RankStages& stages, const ProcessGroup& pp,
                                                  bool bf16_autocast, c10::Device device) {
  std::vector<pipeline::Stage> handles;
  for (const auto& [module, stage] : stages.stages) {
    handles.push_back({.index = stage.index,
                       .forward = [forward = stage.forward, bf16 = bf16_autocast,
                                   type = device.type()](const at::Tensor& x) {
                         const AutocastScope autocast(bf16, type);
                         return forward(x);
                       }});
  }
  const at::ScalarType dtype = stage_activation_dtype(stages.stages);
  auto activation = [spec_of = stages.activation, dtype](int stage) {
    auto spec = spec_of(stage);
    spec.dtype = dtype;
    return spec;
  };
  return std::make_unique<pipeline::Executor>(stages.program, pp, std::move(handles),
                                              std::move(activation));
}

// After each compute action: the strategies may free what only that action needed
// (ParallelModel::action_done, told the module of the rank's next compute action), and each local
// stage's gradients are final after its last action that adds to them (B, I or W): its
// data-parallel reductions start there and overlap the rest of the program.
void sync_after_actions(pipeline::Executor& executor, const RankStages& stages,
                        parallel::ParallelModel* parallel) {
  std::map<int, std::size_t> module_of;  // stage -> its module's index in the parallel model
  for (std::size_t k = 0; k < stages.stages.size(); ++k) {
    module_of[stages.stages[k].second.index] = k;
  }
  std::map<int, pipeline::Action> last_gradient;  // stage -> that action
  // Each compute action and the module of the next one (-1 after the last).
  std::vector<std::pair<pipeline::Action, int64_t>> next_module;
  for (const auto& a : stages.program.ranks[static_cast<std::size_t>(executor.rank())]) {
    if (!a.is_compute()) {
      continue;
    }
    if (a.op != pipeline::Op::forward) {
      last_gradient[a.stage] = a;
    }
    if (!next_module.empty()) {
      next_module.back().second = static_cast<int64_t>(module_of.at(a.stage));
    }
    next_module.emplace_back(a, -1);
  }
  executor.on_compute([parallel, last_gradient = std::move(last_gradient),
                       module_of = std::move(module_of),
                       next_module = std::move(next_module)](const pipeline::Action& a, bool done) {
    if (!done) {
      return;
    }
    const auto next = std::find_if(next_module.begin(), next_module.end(),
                                   [&](const auto& entry) { return entry.first == a; });
    parallel->action_done(module_of.at(a.stage), next == next_module.end() ? -1 : next->second);
    const auto it = last_gradient.find(a.stage);
    if (it != last_gradient.end() && it->second == a) {
      RECORD_USER_SCOPE("d9d::gradient_sync_start");
      parallel->module_done(module_of.at(a.stage));
    }
  });
}

}  // namespace

PipelineStepCore::PipelineStepCore(std::unique_ptr<parallel::ParallelModel> model,
                                   PipelineParts parts, TrainStepOptions options,
                                   const parallel::StepContributions& contributions)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.parallel = std::move(model);
  const auto& mesh = s.parallel->mesh();
  s.parts = std::move(parts);
  s.options = std::move(options);
  s.pp = mesh.group(MeshDomain::regular, "pp");
  s.loss_groups.push_back(s.pp);
  for (auto& group : contributions.loss_groups(mesh)) {
    s.loss_groups.push_back(std::move(group));
  }
  s.device = mesh.context().device();
  s.schedule = optim::PiecewiseSchedule::build(s.options.lr_schedule, s.options.total_steps);
  for (const auto& item : s.parts.stages.stages) {
    s.holds_first = s.holds_first || item.second.index == 0;
    s.holds_last = s.holds_last || item.second.index == s.parts.stages.program.stages() - 1;
  }
  s.executor = make_executor(s.parts.stages, s.pp, s.options.bf16_autocast, s.device);
  sync_after_actions(*s.executor, s.parts.stages, s.parallel.get());
  s.optimizer = make_adamw(s.parallel->parameters(), s.options);
}

PipelineStepCore::~PipelineStepCore() = default;

std::vector<std::shared_ptr<torch::nn::Module>> PipelineStepCore::modules() const {
  return impl_->parts.stages.list();
}

parallel::ParallelModel& PipelineStepCore::parallel() { return *impl_->parallel; }
const pipeline::Program& PipelineStepCore::program() const { return impl_->parts.stages.program; }
torch::optim::Optimizer& PipelineStepCore::optimizer() { return *impl_->optimizer; }

ExportResult PipelineStepCore::export_model(const ExportRequest& request) {
  return export_stages(*impl_->parallel, modules(), program(), request);
}

std::string PipelineStepCore::describe() const {
  const auto& program = impl_->parts.stages.program;
  return ", pipeline of " + std::to_string(program.stages()) + " stages (" +
         std::to_string(program.stages_per_rank) + " per rank, " +
         (program.placement == pipeline::Placement::v ? "V" : "loop") + " placement" +
         (program.split_backward ? ", split backward" : "") + ")";
}

StepResult PipelineStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  const auto m = static_cast<std::size_t>(s.parts.stages.program.microbatches);
  if (microbatches.size() != m) {
    throw std::invalid_argument("d9d::Trainer: the pipeline program runs " + std::to_string(m) +
                                " microbatches per step, the step has " +
                                std::to_string(microbatches.size()));
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  begin_step(*s.optimizer, lr);
  s.parallel->begin_step();

  // The step's microbatches on the device before the program runs, copied without waiting for
  // the device (TrainStepOptions::copier). A copy inside the last stage's loss (the task moving
  // its targets) waited for everything queued before it, the receives of the stage's input
  // included: on 2 x H200 that held the last stage's host 220 ms per step
  // (docs/measurements/2026-11-29-pipelined-step-trace-2xh200.txt).
  std::vector<std::any> on_device;
  if ((s.holds_first || s.holds_last) && s.options.copier.clone) {
    RECORD_USER_SCOPE("d9d::microbatches_to_device");
    on_device.reserve(m);
    for (const auto& microbatch : microbatches) {
      on_device.push_back(s.options.copier.clone(microbatch, s.device));
    }
  }
  const auto& batches = on_device.empty() ? microbatches : on_device;
  std::vector<at::Tensor> inputs;
  if (s.holds_first) {
    inputs.reserve(m);
    for (const auto& microbatch : batches) {
      inputs.push_back(s.parts.input(microbatch).to(s.device));
    }
  }
  at::Tensor loss_sum;
  at::Tensor weight_sum;
  const bool draw = step == s.options.timeline_step;
  s.executor->record_timeline(draw);
  {
    // Bf16 mixed: each weight cast once for the program, not once per microbatch (and one copy
    // for all the microbatches in flight).
    const WeightCastScope casts(s.options.bf16_autocast);
    (void)s.executor->run(inputs, [&](const at::Tensor& output, int mb) {
      LossOutput out;
      {
        const AutocastScope autocast(s.options.bf16_autocast, s.device.type());
        out = s.parts.loss(output, batches[static_cast<std::size_t>(mb)]);
      }
      accumulate_loss(out, loss_sum, weight_sum, "output_loss");
      return out.loss_sum;
    });
  }
  {
    RECORD_USER_SCOPE("d9d::gradient_sync");
    s.parallel->finish();
  }
  if (draw) {
    // "logging.pipeline_timeline_step": every pipeline rank's actions of this step, gathered
    // (collective over pp) and drawn under the program as planned at the measured costs.
    const auto measured = pipeline::gather_timeline(s.pp, s.executor->timeline());
    const auto& context = s.parallel->mesh().context();
    if (context.rank() == 0) {
      const auto& program = s.parts.stages.program;
      track::write_text_file(
          s.options.timeline_path,
          pipeline::planned_and_measured_svg(
              program,
              {{.title = "measured, step " + std::to_string(step + 1), .timeline = measured}},
              "pipeline pp=" + std::to_string(program.pp) + ", " +
                  std::to_string(program.stages()) + " stages, " +
                  std::to_string(program.microbatches) + " microbatches"));
      context.logger().info("pipeline timeline: " + s.options.timeline_path);
    }
  }

  // Only the last stage's ranks hold loss sums: sum over the pipeline, then over the replicas.
  const auto totals = global_totals(loss_sum, weight_sum, s.loss_groups, s.device);
  // Each pipeline rank holds its stages' gradients: the layer sums the norm's squares over pp too.
  return finish_step(*s.optimizer, s.options, step, lr, totals, *s.parallel,
                     s.parallel->mesh().context().world());
}

}  // namespace d9d::detail
