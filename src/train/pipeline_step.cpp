// d9d/train/pipeline_step.cpp — the pipelined optimizer step: program, dp reduction, clipping.
#include <map>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/pipeline/picture.hpp>
#include <d9d/track/progress.hpp>
#include <d9d/train/detail/build.hpp>
#include <d9d/train/detail/step_parts.hpp>
#include <d9d/train/pipeline_step.hpp>

namespace d9d::detail {

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
  ProcessGroup dp;
  std::unique_ptr<pipeline::Executor> executor;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  optim::PiecewiseSchedule schedule;
  c10::Device device = c10::Device(c10::kCPU);
  bool holds_first = false;
};

PipelineStepCore::PipelineStepCore(std::unique_ptr<parallel::ParallelModel> model,
                                   PipelineParts parts, TrainStepOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.parallel = std::move(model);
  const auto& mesh = s.parallel->mesh();
  s.parts = std::move(parts);
  s.options = std::move(options);
  s.pp = mesh.group(MeshDomain::regular, "pp");
  s.dp = mesh.group(MeshDomain::batch, "dp");
  s.device = mesh.context().device();
  s.schedule = optim::PiecewiseSchedule::build(s.options.lr_schedule, s.options.total_steps);

  std::vector<pipeline::Stage> handles;
  for (auto& [module, stage] : s.parts.stages) {
    s.holds_first = s.holds_first || stage.index == 0;
    // The stage's forward under the plan's precision (its backward follows autograd's record).
    handles.push_back({.index = stage.index,
                       .forward = [forward = stage.forward, bf16 = s.options.bf16_autocast,
                                   type = s.device.type()](const at::Tensor& x) {
                         const AutocastScope autocast(bf16, type);
                         return forward(x);
                       }});
  }
  // Activations cross stages in the dtype of the modules' parameters (stage_activation_dtype).
  const at::ScalarType dtype = stage_activation_dtype(s.parts.stages);
  auto activation = [spec_of = s.parts.activation, dtype](int stage) {
    auto spec = spec_of(stage);
    spec.dtype = dtype;
    return spec;
  };
  s.executor = std::make_unique<pipeline::Executor>(s.parts.program, s.pp, std::move(handles),
                                                    std::move(activation));
  // Each local stage's gradients are final after its last action that adds to them (B, I or W):
  // its data-parallel reductions start there and overlap the rest of the program.
  std::map<int, pipeline::Action> last_gradient;  // stage -> that action
  for (const auto& a : s.parts.program.ranks[static_cast<std::size_t>(s.executor->rank())]) {
    if (a.op == pipeline::Op::backward || a.op == pipeline::Op::backward_input ||
        a.op == pipeline::Op::backward_weight) {
      last_gradient[a.stage] = a;
    }
  }
  std::map<int, std::size_t> module_of;  // stage -> its module's index in the parallel model
  for (std::size_t k = 0; k < s.parts.stages.size(); ++k) {
    module_of[s.parts.stages[k].second.index] = k;
  }
  s.executor->on_compute([parallel = s.parallel.get(), last_gradient = std::move(last_gradient),
                          module_of = std::move(module_of)](const pipeline::Action& a, bool done) {
    if (!done) {
      return;
    }
    const auto it = last_gradient.find(a.stage);
    if (it != last_gradient.end() && it->second == a) {
      RECORD_USER_SCOPE("d9d::gradient_sync_start");
      parallel->module_done(module_of.at(a.stage));
    }
  });
  s.optimizer = make_adamw(s.parallel->parameters(), s.options);
}

PipelineStepCore::~PipelineStepCore() = default;

std::vector<std::shared_ptr<torch::nn::Module>> PipelineStepCore::stages() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& item : impl_->parts.stages) {
    out.push_back(item.first);
  }
  return out;
}

parallel::ParallelModel& PipelineStepCore::parallel() { return *impl_->parallel; }
const pipeline::Program& PipelineStepCore::program() const { return impl_->parts.program; }
torch::optim::Optimizer& PipelineStepCore::optimizer() { return *impl_->optimizer; }

StepResult PipelineStepCore::run(const std::vector<std::any>& microbatches, int64_t step) {
  auto& s = *impl_;
  const auto m = static_cast<std::size_t>(s.parts.program.microbatches);
  if (microbatches.size() != m) {
    throw std::invalid_argument("d9d::Trainer: the pipeline program runs " + std::to_string(m) +
                                " microbatches per step, the step has " +
                                std::to_string(microbatches.size()));
  }
  const double lr = s.options.optimizer.lr * s.schedule.multiplier(step);
  begin_step(*s.optimizer, lr);
  s.parallel->begin_step();

  std::vector<at::Tensor> inputs;
  if (s.holds_first) {
    inputs.reserve(m);
    for (const auto& microbatch : microbatches) {
      inputs.push_back(s.parts.input(microbatch).to(s.device));
    }
  }
  at::Tensor loss_sum;
  at::Tensor weight_sum;
  const bool draw = step == s.options.timeline_step;
  s.executor->record_timeline(draw);
  (void)s.executor->run(inputs, [&](const at::Tensor& output, int mb) {
    LossOutput out;
    {
      const AutocastScope autocast(s.options.bf16_autocast, s.device.type());
      out = s.parts.loss(output, microbatches[static_cast<std::size_t>(mb)]);
    }
    accumulate_loss(out, loss_sum, weight_sum, "output_loss");
    return out.loss_sum;
  });
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
      const auto& program = s.parts.program;
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
  const auto totals = global_totals(loss_sum, weight_sum, {&s.pp, &s.dp}, s.device, step);
  // Each pipeline rank holds its stages' gradients: the layer sums the norm's squares over pp too.
  const double grad_norm = s.parallel->normalize_and_clip(totals.second, s.options.max_grad_norm);
  return finish_step(*s.optimizer, s.options, step, lr, totals, grad_norm,
                     s.parallel->mesh().context().world());
}

}  // namespace d9d::detail
