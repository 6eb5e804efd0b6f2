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
// The constructor resolves the plan's mesh against the world (dynamic degrees from the config),
// checks the config against it, builds the mesh, the model (same seed on every rank; replicas then
// start from rank 0's parameters) and the dataset, and composes a TrainStep<Plan>. train() runs
// `run.total_steps` steps: each data-parallel rank reads its strided share of the step's global
// batch (d9d::data::DistributedSampler), splits it into microbatches, and the step accumulates,
// reduces, clips and updates. The main rank shows a progress bar and writes metrics.jsonl and a
// TensorBoard event file; at the end it exports the model (safetensors + config.json; with LoRA
// adapters, the merged model and the adapter in Hugging Face peft's format; under a pipeline plan
// the stages' owners send their parameters to the main rank, one tensor group at a time, and a
// tied embedding is written once — LoRA export under a pipeline is rejected). With the
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
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/detail/build.hpp>
#include <d9d/train/events.hpp>
#include <d9d/train/pipeline_step.hpp>
#include <d9d/train/train_step.hpp>

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
  double tokens_per_second = 0.0;   ///< over all ranks, after the first step (0 without tokens)
  double samples_per_second = 0.0;  ///< over all ranks, after the first step
  /// The most device memory any rank's allocator had allocated during train() (CUDA; 0 on CPU).
  int64_t peak_memory_bytes = 0;
  /// This rank's host time issuing a step's forward and backward (StepResult::issue_seconds),
  /// averaged over the steps after the first; 0 under pipeline plans, which do not measure it.
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

/// The user's model, data and task behind type erasure, so the loop is compiled once.
struct ErasedRun {
  std::shared_ptr<torch::nn::Module> model;
  MicrobatchLoss loss;
  /// After each microbatch's loss (the task's metrics), outside CUDA graphs; may be empty.
  std::function<void(const LossOutput&, const std::any&)> after_microbatch;
  MicrobatchCopier copier;  ///< for CUDA graphs' captured microbatch (the dataset's batch type)
  int64_t dataset_size = 0;
  std::function<std::any(const std::vector<int64_t>&)> load;
  std::function<std::vector<std::any>(const std::any&, int64_t)> split;
  std::string hf_config_json;  ///< from the provider's hf_config_json(), if it has one
  /// From the provider's hf_export_mapper(names), if it has one: model names -> checkpoint names.
  std::function<state::Mapper(const std::vector<std::string>&)> hf_export_mapper;
  /// From the provider's hf_load_mapper(source_keys, names), if it has one: checkpoint keys ->
  /// this rank's parameter names, for "checkpoint.init_from" (else the names map as they are).
  std::function<state::Mapper(const std::vector<std::string>&, const std::vector<std::string>&)>
      hf_load_mapper;
  std::optional<PipelineParts> pipeline;  ///< pipeline plans: the stages instead of `model`
  /// The parallelize layer's result for `model` (or the pipeline's stages).
  std::unique_ptr<parallel::ParallelModel> parallel;
  std::optional<ErasedMetrics> metrics;  ///< the task's metrics, when it declares them
};

/// The parallelize layer's knobs from the config.
inline parallel::ParallelizeOptions parallelize_options(const TrainerConfig& config,
                                                        bool pipelined) {
  return {
      .bucket_bytes = static_cast<int64_t>(config.data_parallel.bucket_size_mb * 1024.0 * 1024.0),
      .reshard = config.data_parallel.reshard,
      .prefetch = static_cast<int>(config.data_parallel.prefetch),
      .reduce_every_microbatch = config.data_parallel.reduce_every_microbatch,
      .pipelined = pipelined,
      .seed = config.run.seed};
}

class TrainerCore {
 public:
  TrainerCore(DistributedContext context, std::shared_ptr<const DeviceMesh> mesh,
              TrainerConfig config, PrecisionOptions precision, ErasedRun run);
  ~TrainerCore();
  TrainerCore(const TrainerCore&) = delete;
  TrainerCore& operator=(const TrainerCore&) = delete;
  TrainerCore(TrainerCore&&) = delete;
  TrainerCore& operator=(TrainerCore&&) = delete;

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
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& model() const;
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

}  // namespace detail

/// The training loop of `Plan` (see the file comment).
template <class Plan>
class Trainer {
 public:
  template <class ModelProvider, class DatasetProvider, class Task>
  Trainer(DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
          TrainerConfig config) {
    detail::check_step_plan<Plan>();
    if (config.run.failure_timeout_s) {
      context.set_failure_timeout(std::chrono::milliseconds(
          static_cast<int64_t>(std::llround(*config.run.failure_timeout_s * 1000.0))));
    }
    static_assert(model_provider_opts_in<ModelProvider>,
                  "d9d::Trainer: the model provider does not opt in. Fix: declare "
                  "`using model_provider_concept = d9d::model_provider_tag;` in it");
    static_assert(model_provider_builds_a_module<ModelProvider>,
                  "d9d::Trainer: the model provider needs `build(const d9d::ModelBuildContext&)` "
                  "returning a module holder (a TORCH_MODULE type)");
    static_assert(dataset_provider_opts_in<DatasetProvider>,
                  "d9d::Trainer: the dataset provider does not opt in. Fix: declare "
                  "`using dataset_provider_concept = d9d::dataset_provider_tag;` in it");
    static_assert(dataset_provider_builds_a_dataset<DatasetProvider>,
                  "d9d::Trainer: the dataset provider needs `build(const d9d::DataBuildContext&)` "
                  "returning a dataset with `int64_t size()` and `get(const "
                  "std::vector<int64_t>& indices)` giving a batch");
    if constexpr (!kPipelined) {
      if constexpr (model_provider<ModelProvider> && dataset_provider<DatasetProvider>) {
        build(std::move(context), std::move(models), std::move(datasets), std::move(task),
              std::move(config));
      }
    } else {
      static_assert(model_provider_builds_stages<ModelProvider>,
                    "d9d::Trainer: a pipeline plan needs the model provider's `build_stage(const "
                    "d9d::StageBuildContext&)` returning a module holder with forward(at::Tensor), "
                    "input_sizes(batch, seq) and output_sizes(batch, seq) (d9d::Qwen3Provider has "
                    "it)");
      if constexpr (model_provider<ModelProvider> && dataset_provider<DatasetProvider> &&
                    model_provider_builds_stages<ModelProvider>) {
        build_pipelined(std::move(context), std::move(models), std::move(datasets), std::move(task),
                        std::move(config));
      }
    }
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
  static constexpr bool kPipelined = detail::is_pipelined_v<Plan>;

  // The dataset and its loading, type-erased into `run`.
  template <class DatasetProvider, class Batch>
  static void add_data(DatasetProvider& datasets, const DeviceMesh& mesh,
                       const TrainerConfig& config, detail::ErasedRun& run) {
    using Dataset = dataset_of_t<DatasetProvider>;
    auto dataset = std::make_shared<Dataset>(
        datasets.build(DataBuildContext{.sequence_length = config.batch.sequence_length,
                                        .seed = config.run.seed,
                                        .dp_rank = mesh.coordinate(MeshDomain::batch, "dp"),
                                        .dp_size = mesh.size(MeshDomain::batch, "dp"),
                                        .config_json = config.section("data"),
                                        .model_config_json = config.section("model")}));
    run.dataset_size = static_cast<int64_t>(dataset->size());
    run.load = [dataset](const std::vector<int64_t>& indices) -> std::any {
      return std::any(Batch(dataset->get(indices)));
    };
    if constexpr (splittable_batch<Batch>) {  // else the constructor's static_assert says why
      run.split = [](const std::any& batch, int64_t parts) {
        std::vector<std::any> out;
        for (auto& part :
             split_batch(std::any_cast<const Batch&>(batch), static_cast<int>(parts))) {
          out.emplace_back(std::move(part));
        }
        return out;
      };
    }
  }

  // The task's metrics, if it declares them: the collection goes into `run` (synced and logged
  // by the loop); the returned function adds a microbatch to it (empty when there is nothing to
  // update on this rank). Tensor- and context-parallel ranks read the same samples, so only their
  // group's first rank counts them: one sum over the world then counts every sample once.
  template <class Task, class Batch>
  static std::function<void(const LossOutput&, const std::any&)> add_metrics(
      const std::shared_ptr<Task>& task, const DeviceMesh& mesh, detail::ErasedRun& run) {
    static_assert(train_task_declares_metrics<Task> || !train_task_names_update_metrics<Task>,
                  "d9d::Trainer: the task has update_metrics but no `metrics() const`. Fix: add "
                  "`d9d::metrics::MetricCollection metrics() const` building the collection "
                  "update_metrics adds to (d9d/metrics/collection.hpp, library //src/metrics)");
    if constexpr (train_task_declares_metrics<Task>) {
      static_assert(synced_metric_collection<task_metrics_t<Task>>,
                    "d9d::Trainer: the task's metrics() must return a "
                    "d9d::metrics::MetricCollection (d9d/metrics/collection.hpp, library "
                    "//src/metrics) or a type with reset, sync_start, sync_wait, compute_synced");
      static_assert(train_task_updates_metrics<Task, Batch>,
                    "d9d::Trainer: the task declares metrics() but has no `void "
                    "update_metrics(const d9d::LossOutput& out, const Batch& batch, "
                    "d9d::metrics::MetricCollection& metrics)` for the dataset's batch type. "
                    "Fix: add it (the trainer calls it after each microbatch's loss; put the "
                    "model's output into LossOutput::output), or remove metrics()");
      if constexpr (train_task_updates_metrics<Task, Batch>) {
        using Collection = task_metrics_t<Task>;
        auto collection = std::make_shared<Collection>(std::as_const(*task).metrics());
        run.metrics =
            detail::ErasedMetrics{.sync_start =
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
    }
    return {};
  }

  // The provider's hf_config_json and hf_export_mapper, if it has them (after build).
  template <class ModelProvider>
  static void add_hf_export(const ModelProvider& models, detail::ErasedRun& run) {
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
  }

  // The verified program: at compile time when pp and the microbatch count are static.
  static pipeline::Program make_program(const MeshShape& shape, int microbatches) {
    using S = typename Plan::pipeline;
    using Mesh = typename Plan::mesh;
    if constexpr (S::microbatches != dynamic) {
      if (microbatches != S::microbatches) {
        throw ConfigError(
            "d9d config: the plan's schedule runs " + std::to_string(S::microbatches) +
            " microbatches per step, the batch section gives " + std::to_string(microbatches) +
            " (global_batch_size / (data-parallel size x microbatch_size)). Fix: "
            "change the batch sizes or d9d::pipeline::microbatches<N>");
      }
      if constexpr (!Mesh::pp::is_dynamic) {
        return pipeline::static_program<S, Mesh::pp::value>();  // its checks run when compiled
      }
    }
    try {
      return pipeline::build_program<S>(shape.pp, microbatches);
    } catch (const std::invalid_argument& error) {
      throw ConfigError(std::string("d9d config: ") + error.what());
    }
  }

  template <class ModelProvider, class DatasetProvider, class Task>
  void build_pipelined(DistributedContext context, ModelProvider models, DatasetProvider datasets,
                       Task task, TrainerConfig config) {
    using Batch = batch_of_t<DatasetProvider>;
    static_assert(splittable_batch<Batch>,
                  "d9d::Trainer: the dataset's batch type " D9D_UNSPLITTABLE_BATCH_FIX);
    static_assert(train_task_opts_in<Task>,
                  "d9d::Trainer: the task does not opt in. Fix: declare "
                  "`using train_task_concept = d9d::train_task_tag;` in it");
    static_assert(pipeline_train_task<Task, Batch>,
                  "d9d::Trainer: a pipeline plan needs the task's `at::Tensor stage_input(const "
                  "Batch&)` (the first stage's input) and `d9d::LossOutput output_loss(const "
                  "at::Tensor& output, const Batch&)` (the loss of the last stage's output)");
    if constexpr (pipeline_train_task<Task, Batch>) {
      detail::require_sequence_length(config);
      auto mesh = detail::make_plan_mesh<Plan>(context, config);
      const int dp = mesh->size(MeshDomain::batch, "dp");
      const auto program =
          make_program(mesh->shape(), static_cast<int>(config.microbatches_per_step(dp)));

      detail::ErasedRun run;
      detail::PipelineParts parts;
      parts.program = program;
      auto built = detail::build_rank_stages(models, context, *mesh, config, program);
      auto modules = built.modules();
      parts.stages = std::move(built.stages);
      parts.activation = std::move(built.activation);
      auto shared_task = std::make_shared<Task>(std::move(task));
      parts.input = [shared_task](const std::any& microbatch) {
        return shared_task->stage_input(std::any_cast<const Batch&>(microbatch));
      };
      const auto update = add_metrics<Task, Batch>(shared_task, *mesh, run);
      parts.loss = [shared_task, update](const at::Tensor& output, const std::any& microbatch) {
        auto out = shared_task->output_loss(output, std::any_cast<const Batch&>(microbatch));
        if (update) {
          LossOutput seen = out;
          if (!seen.output.defined()) {
            seen.output = output;
          }
          update(seen, microbatch);
        }
        return out;
      };
      run.parallel = parallel::parallelize<Plan>(*mesh, std::move(modules),
                                                 detail::parallelize_options(config, true));
      run.pipeline = std::move(parts);
      add_hf_export(models, run);
      run.hf_load_mapper = detail::hf_load_mapper_of(models);
      add_data<DatasetProvider, Batch>(datasets, *mesh, config, run);
      core_ = std::make_unique<detail::TrainerCore>(
          std::move(context), std::move(mesh), std::move(config), detail::precision_options<Plan>(),
          std::move(run));
    }
  }

  template <class ModelProvider, class DatasetProvider, class Task>
  void build(DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
             TrainerConfig config) {
    using Model = model_of_t<ModelProvider>;
    using Batch = batch_of_t<DatasetProvider>;
    static_assert(splittable_batch<Batch>,
                  "d9d::Trainer: the dataset's batch type " D9D_UNSPLITTABLE_BATCH_FIX);
    static_assert(train_task_opts_in<Task>,
                  "d9d::Trainer: the task does not opt in. Fix: declare "
                  "`using train_task_concept = d9d::train_task_tag;` in it");
    static_assert(train_task_computes_loss<Task, Model, Batch>,
                  "d9d::Trainer: the task needs `d9d::LossOutput compute_loss(Model&, const "
                  "Batch&)` for the provider's model and the dataset's batch type");
    if constexpr (train_task<Task, Model, Batch>) {
      auto mesh = detail::make_plan_mesh<Plan>(context, config);
      torch::manual_seed(config.run.seed);  // the same initialisation on every rank
      Model model = models.build(ModelBuildContext{
          .device = context.device(), .mesh = mesh.get(), .config_json = config.section("model")});
      detail::ErasedRun run;
      run.model = model.ptr();
      run.parallel = parallel::parallelize<Plan>(*mesh, {run.model},
                                                 detail::parallelize_options(config, false));
      auto shared_task = std::make_shared<Task>(std::move(task));
      run.after_microbatch = add_metrics<Task, Batch>(shared_task, *mesh, run);
      run.loss = [model, shared_task](const std::any& microbatch) mutable {
        return shared_task->compute_loss(model, std::any_cast<const Batch&>(microbatch));
      };
      run.copier = microbatch_copier<Batch>();
      add_data<DatasetProvider, Batch>(datasets, *mesh, config, run);
      add_hf_export(models, run);
      run.hf_load_mapper = detail::hf_load_mapper_of(models);
      core_ = std::make_unique<detail::TrainerCore>(
          std::move(context), std::move(mesh), std::move(config), detail::precision_options<Plan>(),
          std::move(run));
    }
  }

  std::unique_ptr<detail::TrainerCore> core_;
};

}  // namespace d9d
