// d9d/train/trainer.hpp — Trainer<Plan>: the training loop of a plan around user-provided pieces.
//
//   int main(int argc, char** argv) {
//     return d9d::run_main(argc, argv, [](int, char** argv) {  // errors: one line, exit 2 or 1
//       auto ctx = d9d::DistributedContext::from_env();
//       auto cfg = d9d::TrainerConfig::from_file(argv[1]);
//       d9d::Trainer<MyPlan> trainer{ctx, MyModelProvider{}, MyDataset{}, MyTask{}, cfg};
//       trainer.on<d9d::events::StepEnd>([](const auto& e) { ... });
//       d9d::TrainResult result = trainer.train();
//       return 0;
//     });
//   }
//
// A whole program of one's own model, data and task: examples/06_classifier/main.cpp. Without
// d9d::run_main (d9d/train/main.hpp) a d9d::ConfigError escaping main aborts every rank.
//
// The constructor composes the plan (d9d::compose, d9d/train/compose.hpp: the mesh resolved against
// the world with dynamic degrees from the config and checked, the model or this rank's pipeline
// stages built with the same seed on every rank, the strategies applied; replicas then start from
// rank 0's parameters), builds the dataset, and holds the one step the plan's pipeline slot chooses
// (d9d::step_component, d9d/train/step.hpp). train() runs
// `run.total_steps` steps: each data-parallel rank reads its strided share of the step's global
// batch (d9d::data::DistributedSampler), splits it into microbatches, and the step accumulates,
// reduces, clips and updates. The main rank shows a progress bar and writes metrics.jsonl and a
// TensorBoard event file; at the end it exports the model (safetensors + config.json; with LoRA
// adapters, the merged model and the adapter in Hugging Face peft's format; under a pipeline plan
// the stages' owners send their parameters to the main rank, one tensor group at a time, and a
// tied embedding is written once; LoRA adapters are merged per stage and written as one peft
// adapter). With the
// config's "checkpoint" section it saves training checkpoints and resumes from the latest one
// (d9d/train/checkpoint.hpp). A task that declares metrics (d9d/train/concepts.hpp) has them
// updated per microbatch, synchronised over the ranks at the end of each logged step and written
// next to the loss as "metrics/<name>".
#pragma once

#include <any>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/train/compose.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>
#include <d9d/train/step.hpp>

namespace d9d {

/// What a finished run reports (the same on every rank, except the file paths, which are set on
/// the main rank).
struct TrainResult {
  std::vector<double> losses;      ///< per step run (from start_step on)
  std::vector<double> grad_norms;  ///< per step run, before clipping
  /// Steps (0-based) skipped for a NaN or infinite loss or gradient norm (numerics.on_nonfinite
  /// "skip"): the optimizer did not step; their losses and norms above are the non-finite values.
  std::vector<int64_t> skipped_steps;
  std::vector<int64_t> loss_spikes;  ///< steps (0-based) whose loss was a spike (events::LossSpike)
  int64_t start_step = 0;            ///< the checkpoint's step when resumed, else 0
  std::string resumed_from;          ///< the checkpoint resumed from (empty when none)
  std::string checkpoint_dir;        ///< the last checkpoint written (empty when none)
  int64_t steps = 0;                 ///< steps run
  double seconds = 0.0;
  /// Over all ranks, timed after the warm-up: the first step and, with CUDA graphs, the eager
  /// warm-up steps and the capture (0 without tokens; the first step alone is left out of runs
  /// too short for the rest).
  double tokens_per_second = 0.0;
  double samples_per_second = 0.0;  ///< over all ranks, timed as tokens_per_second
  /// The most device memory any rank's allocator had allocated during train() (CUDA; 0 on CPU).
  int64_t peak_memory_bytes = 0;
  /// This rank's host time issuing a step's forward and backward (StepResult::issue_seconds),
  /// averaged over the steps timed for tokens_per_second; 0 under pipeline plans, which do not
  /// measure it.
  double issue_seconds_per_step = 0.0;
  /// Microbatches that replayed a CUDA graph on this rank (config "cuda_graphs"; 0 without).
  int64_t graph_replays = 0;
  /// The task's metrics (train_task_declares_metrics) as last logged, synced over every rank:
  /// keys "metrics/<name>" or "metrics/<name>/<key>", the same on every rank (empty without).
  std::map<std::string, double> metrics;
  std::string metrics_path;     ///< metrics.jsonl (empty when disabled)
  std::string tensorboard_dir;  ///< (empty when disabled)
  /// The run's pictures (logging.pictures, main rank): the learning rate of every step and the
  /// loss of every step run, as SVG line charts next to metrics.jsonl (empty when disabled).
  std::string lr_schedule_svg;
  std::string loss_svg;
  std::string export_dir;   ///< the exported model (empty when disabled); LoRA merged in
  std::string adapter_dir;  ///< the exported LoRA adapter, peft's format (empty when none)
};

namespace detail {

/// A task's metrics behind type erasure (the collection lives in the trainer's closures).
struct ErasedMetrics {
  /// Launches the all-reduce of a snapshot of the state over `group`, then resets the state (the
  /// next logging window starts at once).
  std::function<void(const ProcessGroup&)> sync_start;
  /// Waits for the pending sync and computes the snapshot's values ("<name>" / "<name>/<key>").
  std::function<std::map<std::string, double>()> synced;
};

/// The user's data, metrics and checkpoint hooks behind type erasure, so the loop is compiled
/// once (the model and the task are in the step).
struct ErasedRun {
  ErasedData data;
  std::optional<ErasedMetrics> metrics;  ///< the task's metrics, when it declares them
  std::string hf_config_json;            ///< from the provider's hf_config_json(), if it has one
  /// From the provider's hf_export_mapper(names), if it has one: model names -> checkpoint names.
  std::function<state::Mapper(const std::vector<std::string>&)> hf_export_mapper;
  /// From the provider's hf_load_mapper(source_keys, names), if it has one: checkpoint keys ->
  /// this rank's parameter names, for "checkpoint.init_from" (else the names map as they are).
  HfLoadMapper hf_load_mapper;
};

/// The loop of Trainer<Plan>, compiled once (src/train/trainer.cpp): sampling, the steps, and
/// the passes around them (logging, profiling, checkpoints, numerics guards, export).
class TrainerCore {
 public:
  /// The loop's state before its step: `samples` is this rank's share of each global batch (the
  /// strategies' sample split), `microbatches` the step's microbatch count.
  TrainerCore(DistributedContext context, std::shared_ptr<const DeviceMesh> mesh,
              TrainerConfig config, ErasedRun run, parallel::StepContributions::Share samples,
              int64_t microbatches);
  ~TrainerCore();
  TrainerCore(const TrainerCore&) = delete;
  TrainerCore& operator=(const TrainerCore&) = delete;
  TrainerCore(TrainerCore&&) = delete;
  TrainerCore& operator=(TrainerCore&&) = delete;

  /// The step's knobs: the config's, the plan's precision, this loop's events.
  [[nodiscard]] TrainStepOptions step_options(const PrecisionOptions& precision) const;
  /// Takes the step (the one this loop runs), then resumes from a checkpoint or loads
  /// "checkpoint.init_from" as the config says (collective).
  void start(std::unique_ptr<StepCore> step);

  TrainResult train();
  /// One step without logging (what train() does per step); for tests and custom loops.
  StepResult step(int64_t step);
  /// Collective: saves a training checkpoint of the state now (after the steps run so far, or the
  /// resumed step) into the config's checkpoint directory and waits until it is complete;
  /// returns its directory.
  std::string save_checkpoint();
  EventBus& events();
  [[nodiscard]] const DeviceMesh& mesh() const;
  /// The whole model (null under a pipeline plan).
  [[nodiscard]] std::shared_ptr<torch::nn::Module> model() const;
  /// What this rank trains: the whole model, or its pipeline stages in stage order.
  [[nodiscard]] std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
  /// The parallelize layer's result: the parameter records the optimizer, clipping and
  /// checkpoints use (under FullyShard their local tensors are this rank's shards).
  [[nodiscard]] parallel::ParallelModel& parallel();
  /// The optimizer (AdamW) over the records' local tensors.
  [[nodiscard]] torch::optim::Optimizer& optimizer();

  struct Impl;  ///< the loop's state (src/train/trainer.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

/// "run.failure_timeout_s" onto the context (the watchdog's interval).
void apply_failure_timeout(DistributedContext& context, const TrainerConfig& config);

/// The task's metrics, if it declares them: the collection goes into `metrics` (synced and logged
/// by the loop); the returned function adds a microbatch to it (empty when there is nothing to
/// update on this rank). Tensor- and context-parallel ranks read the same samples, so only their
/// group's first rank counts them: one sum over the world then counts every sample once.
template <class Task, class Batch>
std::function<void(const LossOutput&, const std::any&)> erase_metrics(
    const std::shared_ptr<Task>& task, const DeviceMesh& mesh,
    std::optional<ErasedMetrics>& metrics) {
  if constexpr (train_task_updates_metrics<Task, Batch>) {  // trainer_task_metrics holds
    using Collection = task_metrics_t<Task>;
    auto collection = std::make_shared<Collection>(std::as_const(*task).metrics());
    metrics = ErasedMetrics{.sync_start =
                                [collection](const ProcessGroup& group) {
                                  collection->sync_start(group);
                                  collection->reset();
                                },
                            .synced = [collection]() -> std::map<std::string, double> {
                              return collection->compute_synced();
                            }};
    if (mesh.coordinate(MeshDomain::batch, "tp") != 0 ||
        mesh.coordinate(MeshDomain::batch, "cp") != 0) {
      return {};
    }
    return [task, collection](const LossOutput& out, const std::any& microbatch) {
      const at::NoGradGuard no_grad;
      task->update_metrics(out, std::any_cast<const Batch&>(microbatch), *collection);
    };
  }
  return {};
}

/// The provider's checkpoint hooks, if it has them (after build): hf_config_json,
/// hf_export_mapper and hf_load_mapper.
template <class ModelProvider>
void erase_hf_hooks(const ModelProvider& models, ErasedRun& run) {
  if constexpr (requires { models.hf_config_json(); }) {
    run.hf_config_json = models.hf_config_json();
  }
  if constexpr (requires(const std::vector<std::string>& names) {
                  { models.hf_export_mapper(names) } -> std::convertible_to<state::Mapper>;
                }) {
    run.hf_export_mapper = [models](const std::vector<std::string>& names) {
      return models.hf_export_mapper(names);
    };
  }
  run.hf_load_mapper = hf_load_mapper_of(models);
}

}  // namespace detail

// ---- what Trainer<Plan>'s constructor accepts ---------------------------------------------------
// Each part is one atomic constraint carrying its diagnostic (detail::diagnostic): a call with
// inputs that do not fit finds no constructor (std::is_constructible says so), and the compiler's
// note names the part and its fix. The parts are checked in this order.

namespace detail {

template <class Task>
constexpr bool metrics_are_a_collection() {
  if constexpr (train_task_declares_metrics<Task>) {
    return synced_metric_collection<task_metrics_t<Task>>;
  } else {
    return true;
  }
}

}  // namespace detail

template <class P>
concept trainer_model_provider =
    bool(model_provider_opts_in<P>&& detail::diagnostic(
        "d9d::Trainer: the model provider does not opt in. Fix: declare "
        "`using model_provider_concept = d9d::model_provider_tag;` in it")) &&
    bool(model_provider_builds_a_module<P>&& detail::diagnostic(
        "d9d::Trainer: the model provider needs `build(const "
        "d9d::ModelBuildContext&)` returning a module holder (a TORCH_MODULE "
        "type)"));

template <class P>
concept trainer_dataset_provider =
    bool(dataset_provider_opts_in<P>&& detail::diagnostic(
        "d9d::Trainer: the dataset provider does not opt in. Fix: declare "
        "`using dataset_provider_concept = d9d::dataset_provider_tag;` in it")) &&
    bool(dataset_provider_builds_a_dataset<P>&& detail::diagnostic(
        "d9d::Trainer: the dataset provider needs `build(const "
        "d9d::DataBuildContext&)` returning a dataset with `int64_t size()` "
        "and `get(const std::vector<int64_t>& indices)` giving a batch")) &&
    bool(splittable_batch<batch_of_t<P>>&& detail::diagnostic(
        "d9d::Trainer: the dataset's batch type " D9D_UNSPLITTABLE_BATCH_FIX));

/// What the step of `Plan`'s pipeline slot needs of the provider and the task: compute_loss on the
/// whole model without a schedule; stages and the task's stage_input / output_loss with one.
template <class Plan, class P, class Task, class Batch>
concept trainer_step_inputs =
    bool(plan_has_pipeline<Plan> ||
         (train_task_computes_loss<Task, model_of_t<P>, Batch> &&
          detail::diagnostic("d9d::Trainer: the task needs `d9d::LossOutput "
                             "compute_loss(Model&, const Batch&)` for the provider's "
                             "model and the dataset's batch type"))) &&
    bool(!plan_has_pipeline<Plan> ||
         (model_provider_builds_stages<P> &&
          detail::diagnostic("d9d::Trainer: a pipeline plan needs the model provider's "
                             "`build_stage(const d9d::StageBuildContext&)` returning a module "
                             "holder with forward(at::Tensor), input_sizes(batch, seq) and "
                             "output_sizes(batch, seq) (d9d::Qwen3Provider has it)"))) &&
    bool(!plan_has_pipeline<Plan> ||
         (pipeline_train_task<Task, Batch> &&
          detail::diagnostic("d9d::Trainer: a pipeline plan needs the task's `at::Tensor "
                             "stage_input(const Batch&)` (the first stage's input) and "
                             "`d9d::LossOutput output_loss(const at::Tensor& output, const "
                             "Batch&)` (the loss of the last stage's output)")));

/// The task's metrics, when it has any: metrics() building a collection and update_metrics for
/// the dataset's batch type.
template <class Task, class Batch>
concept trainer_task_metrics =
    bool((train_task_declares_metrics<Task> || !train_task_names_update_metrics<Task>)&&detail::
             diagnostic("d9d::Trainer: the task has update_metrics but no `metrics() const`. "
                        "Fix: add `d9d::metrics::MetricCollection metrics() const` building "
                        "the collection update_metrics adds to (d9d/metrics/collection.hpp, "
                        "library //src/metrics)")) &&
    bool(detail::metrics_are_a_collection<Task>() &&
         detail::diagnostic("d9d::Trainer: the task's metrics() must return a "
                            "d9d::metrics::MetricCollection (d9d/metrics/collection.hpp, library "
                            "//src/metrics) or a type with reset, sync_start, sync_wait, "
                            "compute_synced")) &&
    bool((!train_task_declares_metrics<Task> || train_task_updates_metrics<Task, Batch>)&&detail::
             diagnostic("d9d::Trainer: the task declares metrics() but has no `void "
                        "update_metrics(const d9d::LossOutput& out, const Batch& batch, "
                        "d9d::metrics::MetricCollection& metrics)` for the dataset's batch "
                        "type. Fix: add it (the trainer calls it after each microbatch's "
                        "loss; put the model's output into LossOutput::output), or remove "
                        "metrics()"));

/// Everything Trainer<Plan>'s constructor needs of the user's model provider, dataset provider and
/// task (each part with its diagnostic, in this order).
template <class Plan, class ModelProvider, class DatasetProvider, class Task>
concept trainer_inputs =
    trainer_model_provider<ModelProvider> && trainer_dataset_provider<DatasetProvider> &&
    bool(train_task_opts_in<Task>&& detail::diagnostic(
        "d9d::Trainer: the task does not opt in. Fix: declare `using "
        "train_task_concept = d9d::train_task_tag;` in it")) &&
    trainer_step_inputs<
        Plan, ModelProvider, Task,
        batch_of_t<DatasetProvider>>&& trainer_task_metrics<Task, batch_of_t<DatasetProvider>>;

/// The training loop of `Plan` (see the file comment).
template <class Plan>
class Trainer {
  static_assert((detail::check_train_plan<Plan>(), true));
  using Step = step_component<typename Plan::pipeline>;

 public:
  /// Composes the plan, builds the dataset and the step (collective over the world). Constrained
  /// by trainer_inputs: the compiler names the part of the inputs that does not fit.
  template <class ModelProvider, class DatasetProvider, class Task>
  requires trainer_inputs<Plan, ModelProvider, DatasetProvider, Task> Trainer(
      DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
      TrainerConfig config) {
    build<batch_of_t<DatasetProvider>>(std::move(context), models, datasets, std::move(task),
                                       std::move(config));
  }

  /// Runs the configured number of steps (collective over all ranks). An exception leaving it is
  /// noted on the context (DistributedContext::note_failure), so that if it ends this rank, the
  /// other ranks name it.
  TrainResult train() {
    try {
      return core_->train();
    } catch (const std::exception& error) {
      core_->mesh().context().note_failure(error.what());
      throw;
    }
  }
  /// Subscribes to a typed event (d9d/train/events.hpp).
  template <class E>
  void on(std::function<void(const E&)> handler) {
    core_->events().template on<E>(std::move(handler));
  }
  [[nodiscard]] const DeviceMesh& mesh() const { return core_->mesh(); }
  [[nodiscard]] detail::TrainerCore& core() { return *core_; }

 private:
  // Composes the plan, erases the data, metrics and checkpoint hooks, and hands the step the
  // Plan's step component builds to the loop.
  template <class Batch, class ModelProvider, class DatasetProvider, class Task>
  void build(DistributedContext context, ModelProvider& models, DatasetProvider& datasets,
             Task task, TrainerConfig config) {
    detail::apply_failure_timeout(context, config);
    auto composed = compose<Plan>(context, models, config);
    auto shared_task = std::make_shared<Task>(std::move(task));
    detail::ErasedRun run;
    run.data = detail::erase_data<DatasetProvider, Batch>(datasets, *composed.mesh,
                                                          composed.contributions, config);
    auto update = detail::erase_metrics<Task, Batch>(shared_task, *composed.mesh, run.metrics);
    detail::erase_hf_hooks(models, run);
    const auto samples = composed.contributions.samples(*composed.mesh);
    core_ = std::make_unique<detail::TrainerCore>(context, composed.mesh, config, std::move(run),
                                                  samples, composed.microbatches);
    auto options = core_->step_options(detail::precision_options<Plan>());
    core_->start(Step::template train_step<Task, Batch, ModelProvider>(
        std::move(composed), std::move(shared_task), std::move(update), config,
        std::move(options)));
  }

  std::unique_ptr<detail::TrainerCore> core_;
};

}  // namespace d9d
