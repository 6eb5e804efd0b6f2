// d9d/train/pipeline_step.hpp — the pipelined step: one rank's optimizer step when the Plan has a
// pipeline schedule (step_component<Schedule> for every d9d::pipeline::pipeline_schedule).
//
// Each rank holds the stages the schedule's program places on it (built by the model provider's
// build_stage), and a step runs the program through d9d::pipeline::Executor — the first stage
// reads the task's stage_input of each microbatch, the last stage calls the task's output_loss.
// Then, as in the whole-model step: gradients are reduced over the data-parallel ranks (after the
// program), the loss totals are summed over pp and the strategies' loss dims (dp), the gradients
// are divided by the step's global loss weight (the loss is the token mean over every microbatch
// of every data-parallel rank), the gradient norm is summed over the pipeline ranks and clipped,
// and AdamW updates this rank's parameters. The gradient path is the parallelize layer's, with
// the strategies told by the Plan that gradients come from a program (GradientTiming::program:
// weight gradients may come from W actions, so strategies reduce after the program); its last
// part sums the gradients of a parameter tied across stages (a tied embedding's two holders) over
// the ranks that hold it. Losses and gradients equal a single-process step over the same global
// batch (tests/train: Trainer_Pipeline_Gloo, Trainer_PipelineTied_Gloo).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/step.hpp>

namespace d9d {

namespace detail {

/// This rank's stages of a program, each with its forward, and the activation spec of every
/// boundary they touch (sizes for one microbatch; the dtype is the executor's to set).
struct RankStages {
  pipeline::Program program;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>> stages;
  std::function<pipeline::TensorSpec(int stage)> activation;
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> list() const;
};

/// The pieces of a pipelined run, type-erased (the step component fills them from the user's
/// types).
struct PipelineParts {
  RankStages stages;
  /// The first stage's input of a microbatch (the task's stage_input).
  std::function<at::Tensor(const std::any& microbatch)> input;
  /// The loss of the last stage's output (the task's output_loss).
  std::function<LossOutput(const at::Tensor& output, const std::any& microbatch)> loss;
};

/// The pipelined step (compiled once, src/train/pipeline_step.cpp).
class PipelineStepCore final : public StepCore {
 public:
  /// Collective over the mesh (every rank constructs it together). `model`: the parallelize
  /// layer's result for this rank's stage modules (those of `parts`, in the same order).
  PipelineStepCore(std::unique_ptr<parallel::ParallelModel> model, PipelineParts parts,
                   TrainStepOptions options, const parallel::StepContributions& contributions);
  ~PipelineStepCore() override;
  PipelineStepCore(const PipelineStepCore&) = delete;
  PipelineStepCore& operator=(const PipelineStepCore&) = delete;
  PipelineStepCore(PipelineStepCore&&) = delete;
  PipelineStepCore& operator=(PipelineStepCore&&) = delete;

  /// One optimizer step over this pipeline's microbatches (exactly program.microbatches of them;
  /// collective over the pp and dp groups).
  StepResult run(const std::vector<std::any>& microbatches, int64_t step) override;
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> modules() const override;
  [[nodiscard]] std::shared_ptr<torch::nn::Module> whole_model() const override { return {}; }
  [[nodiscard]] parallel::ParallelModel& parallel() override;
  [[nodiscard]] torch::optim::Optimizer& optimizer() override;
  ExportResult export_model(const ExportRequest& request) override;
  [[nodiscard]] std::string describe() const override;
  [[nodiscard]] const pipeline::Program& program() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Pipeline plans size the tensors between stages with "batch.sequence_length": a ConfigError
/// naming the fix when it is not given.
void require_sequence_length(const TrainerConfig& config);

/// The config rules of the pipelined step: no CUDA graphs (a ConfigError naming the fix).
void check_pipeline_config(const TrainerConfig& config);

/// The dtype activations cross stages in: that of the stages' floating-point parameters (what
/// the residual stream computes in; bf16 autocast keeps it there too), i.e. the precision's
/// parameter dtype or the compute dtype of parameters a sharding strategy gathers; float when
/// the stages have none.
at::ScalarType stage_activation_dtype(
    const std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>>& stages);

/// The executor of a forward-only program over this rank's stages (activations in the stages'
/// parameter dtype).
std::shared_ptr<pipeline::Executor> make_forward_executor(const DeviceMesh& mesh,
                                                          const RankStages& stages);

/// `Schedule`'s verified program for pp and the step's microbatch count: checked at compile time
/// when both are static (its checks run when compiled), else at start-up (ConfigError).
template <class Schedule, class Mesh>
pipeline::Program schedule_program(int pp, int microbatches) {
  if constexpr (Schedule::microbatches != dynamic) {
    if (microbatches != Schedule::microbatches) {
      throw ConfigError(
          "d9d config: the plan's schedule runs " + std::to_string(Schedule::microbatches) +
          " microbatches per step, the batch section gives " + std::to_string(microbatches) +
          " (global_batch_size / (data-parallel size x microbatch_size)). Fix: "
          "change the batch sizes or d9d::pipeline::microbatches<N>");
    }
    if constexpr (!Mesh::pp::is_dynamic) {
      return pipeline::static_program<Schedule, Mesh::pp::value>();
    }
  }
  try {
    return pipeline::build_program<Schedule>(pp, microbatches);
  } catch (const std::invalid_argument& error) {
    throw ConfigError(std::string("d9d config: ") + error.what());
  }
}

}  // namespace detail

/// The stages of a pipeline schedule on every rank (see the file comment).
template <pipeline::pipeline_schedule Schedule>
struct step_component<Schedule> {
  template <class Plan>
  static constexpr void check() {}
  static void check_mesh(const MeshShape& /*shape*/) {}

  /// This rank's modules: the stages the program places on it.
  template <class ModelProvider>
  using Modules = detail::RankStages;
  template <class ModelProvider>
  static constexpr bool builds = model_provider_builds_stages<ModelProvider>;

  /// The program (for the plan's mesh type `Mesh`), then the stages it places on this rank (pp
  /// coordinate) from the provider's build_stage. Each stage starts from the run's seed, as the
  /// whole model does: with a provider whose initialisation depends on that and the names only
  /// (d9d::model::init_qwen3_parameters), each stage starts with the whole model's values.
  template <class Plan, class ModelProvider>
  requires model_provider_builds_stages<ModelProvider>
  static detail::RankStages build(ModelProvider& models, const StepBuildInputs& in) {
    detail::RankStages out;
    detail::require_sequence_length(in.config);
    out.program = detail::schedule_program<Schedule, typename Plan::mesh>(
        in.mesh.size(MeshDomain::regular, "pp"), static_cast<int>(in.microbatches));
    // Sizes asked of the stages when the executor is made, after the strategies (a stage under
    // context parallelism holds part of each sequence).
    std::map<int, std::function<std::vector<int64_t>()>> sizes;
    const int64_t b = in.config.batch.microbatch_size;
    const int64_t t = in.config.batch.sequence_length;
    const auto& program = out.program;
    for (const int s : pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank,
                                             in.mesh.coordinate(MeshDomain::regular, "pp"))) {
      torch::manual_seed(in.config.run.seed);
      auto stage = models.build_stage(StageBuildContext{.device = in.context.device(),
                                                        .mesh = &in.mesh,
                                                        .config_json = in.config.section("model"),
                                                        .stage = s,
                                                        .stages = program.stages(),
                                                        .sequence_length = t});
      sizes[s] = [stage, b, t] { return stage->input_sizes(b, t); };
      sizes[s + 1] = [stage, b, t] { return stage->output_sizes(b, t); };
      out.stages.emplace_back(
          stage.ptr(), pipeline::Stage{.index = s, .forward = [stage](const at::Tensor& x) mutable {
                                         return stage->forward(x);
                                       }});
    }
    out.activation = [sizes](int s) {
      const auto it = sizes.find(s);
      if (it == sizes.end()) {
        throw std::logic_error("d9d: no activation spec for stage " + std::to_string(s) +
                               " on this rank");
      }
      return pipeline::TensorSpec{.sizes = it->second()};
    };
    return out;
  }

  /// The training step: the program over this rank's stages; the first stage's input is the
  /// task's stage_input and the last stage's loss its output_loss, each of the microbatch as the
  /// strategies shard it (under context parallelism output_loss also gets this rank's
  /// SequencePart: the last stage's output covers that part only); `after_microbatch` (the task's
  /// metrics) sees the loss output (with the last stage's output when the task left it unset).
  template <class Task, class Batch, class ModelProvider>
  requires pipeline_train_task<Task, Batch>
  static std::unique_ptr<detail::StepCore> train_step(
      Composition<detail::RankStages> composed, std::shared_ptr<Task> task,
      std::function<void(const LossOutput&, const std::any&)> after_microbatch,
      const TrainerConfig& config, TrainStepOptions options) {
    detail::check_pipeline_config(config);
    options.copier = microbatch_copier<Batch>();
    detail::PipelineParts parts{.stages = std::move(composed.modules), .input = {}, .loss = {}};
    const auto& contributions = composed.contributions;
    const auto share = contributions.sequence_part(*composed.mesh);
    const SequencePart part{.index = share.index, .count = share.count};
    if constexpr (!pipeline_task_takes_sequence_part<Task, Batch>) {
      if (!part.whole()) {
        throw ConfigError(
            "d9d: context parallelism splits each sequence over " + std::to_string(part.count) +
            " ranks, so the last pipeline stage's output covers this rank's part only and the "
            "task must cut its targets alike. Fix: give the task `d9d::LossOutput "
            "output_loss(const at::Tensor& output, const Batch& batch, const d9d::SequencePart& "
            "part)` (d9d::CausalLmTask has it), or use d9d::parallel::NoContextParallel");
      }
    }
    parts.input = [task, contributions](const std::any& microbatch) {
      return detail::with_sharded<Batch>(
          contributions, microbatch, [&](const Batch& batch) { return task->stage_input(batch); });
    };
    // Under tensor parallelism a task that takes the vocabulary part gets the last stage's logits
    // split over tp (the loss-parallel cross-entropy); others get them gathered.
    VocabPart vocab;
    if constexpr (pipeline_task_takes_vocab_part<Task, Batch>) {
      for (const auto& [module, stage] : parts.stages.stages) {
        if (auto* model = dynamic_cast<model::VocabParallelModel*>(module.get())) {
          if (auto slice = model->keep_logits_split(); !slice.whole()) {
            vocab.slice = std::move(slice);
          }
        }
      }
    }
    parts.loss = [task, contributions, part, vocab, update = std::move(after_microbatch)](
                     const at::Tensor& output, const std::any& microbatch) {
      auto out = detail::with_sharded<Batch>(contributions, microbatch, [&](const Batch& batch) {
        if constexpr (pipeline_task_takes_vocab_part<Task, Batch>) {
          return task->output_loss(output, batch, part, vocab);
        } else if constexpr (pipeline_task_takes_sequence_part<Task, Batch>) {
          return task->output_loss(output, batch, part);
        } else {
          return task->output_loss(output, batch);
        }
      });
      if (update) {
        LossOutput seen = out;
        if (!seen.output.defined()) {
          seen.output = output;
        }
        update(seen, microbatch);
      }
      return out;
    };
    return std::make_unique<detail::PipelineStepCore>(
        std::move(composed.parallel), std::move(parts), std::move(options), composed.contributions);
  }

  /// The forward step of d9d::Inference: the forward-only program over this rank's stages; the
  /// last stage's ranks give the rows (the task's output of each microbatch's last-stage output).
  template <class Task, class Batch, class ModelProvider>
  static ForwardStep forward_step(Composition<detail::RankStages> composed,
                                  std::shared_ptr<Task> task) {
    static_assert(
        requires(Task & t, const Batch& b, const at::Tensor& out) {
          { t.stage_input(b) } -> std::convertible_to<at::Tensor>;
          { t.output(out, b) } -> std::convertible_to<at::Tensor>;
        },
        "d9d::Inference: a pipeline plan needs the task's `at::Tensor stage_input(const Batch&)` "
        "(the first stage's input) and `at::Tensor output(const at::Tensor& last_stage_output, "
        "const Batch&)` (one row per sample)");
    if (const auto share = composed.contributions.sequence_part(*composed.mesh); share.count > 1) {
      throw ConfigError(
          "d9d::Inference: context parallelism splits each sequence over " +
          std::to_string(share.count) +
          " ranks, which the forward step does not gather back. Fix: run inference with "
          "d9d::parallel::NoContextParallel (\"mesh.cp_shard\": 1)");
    }
    auto executor = detail::make_forward_executor(*composed.mesh, composed.modules);
    ForwardStep out{.parallel = std::move(composed.parallel), .run = {}, .stages_elsewhere = true};
    out.run = [executor, task,
               contributions = composed.contributions](const std::vector<std::any>& microbatches) {
      std::vector<at::Tensor> inputs;
      inputs.reserve(microbatches.size());
      for (const auto& microbatch : microbatches) {
        inputs.push_back(detail::with_sharded<Batch>(
            contributions, microbatch,
            [&](const Batch& batch) -> at::Tensor { return task->stage_input(batch); }));
      }
      const auto result = executor->run(inputs, {});
      if (result.outputs.empty()) {
        return at::Tensor();
      }
      std::vector<at::Tensor> rows;
      rows.reserve(microbatches.size());
      for (std::size_t i = 0; i < microbatches.size(); ++i) {
        rows.push_back(detail::with_sharded<Batch>(contributions, microbatches[i],
                                                   [&](const Batch& batch) -> at::Tensor {
                                                     return task->output(result.outputs[i], batch);
                                                   }));
      }
      return at::cat(rows, 0);
    };
    return out;
  }
};

}  // namespace d9d
