// d9d/train/trainer.hpp — Trainer<Plan>: the training loop of a plan around user-provided pieces.
//
//   auto ctx = d9d::DistributedContext::from_env();
//   auto cfg = d9d::TrainerConfig::from_file(argv[1]);
//   d9d::Trainer<MyPlan> trainer{ctx, MyModelProvider{}, MyDataset{}, MyTask{}, cfg};
//   trainer.on<d9d::events::StepEnd>([](const auto& e) { ... });
//   d9d::TrainResult result = trainer.train();
//
// The constructor resolves the plan's mesh against the world (dynamic degrees from the config),
// checks the config against it, builds the mesh, the model (same seed on every rank; replicas then
// start from rank 0's parameters) and the dataset, and composes a TrainStep<Plan>. train() runs
// `run.total_steps` steps: each data-parallel rank reads its strided share of the step's global
// batch (d9d::data::DistributedSampler), splits it into microbatches, and the step accumulates,
// reduces, clips and updates. The main rank shows a progress bar and writes metrics.jsonl and a
// TensorBoard event file; at the end it exports the model (safetensors + config.json).
#pragma once

#include <any>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {

/// What a finished run reports (the same on every rank, except the file paths, which are set on
/// the main rank).
struct TrainResult {
  std::vector<double> losses;      ///< per step
  std::vector<double> grad_norms;  ///< per step, before clipping
  int64_t steps = 0;
  double seconds = 0.0;
  double tokens_per_second = 0.0;  ///< over all ranks, after the first step
  std::string metrics_path;        ///< metrics.jsonl (empty when disabled)
  std::string tensorboard_dir;     ///< (empty when disabled)
  std::string export_dir;          ///< the exported model (empty when disabled)
};

namespace detail {

/// The user's model, data and task behind type erasure, so the loop is compiled once.
struct ErasedRun {
  std::shared_ptr<torch::nn::Module> model;
  MicrobatchLoss loss;
  int64_t dataset_size = 0;
  std::function<std::any(const std::vector<int64_t>&)> load;
  std::function<std::vector<std::any>(const std::any&, int64_t)> split;
  std::string hf_config_json;  ///< from the provider's hf_config_json(), if it has one
};

class TrainerCore {
 public:
  TrainerCore(DistributedContext context, std::shared_ptr<const DeviceMesh> mesh,
              TrainerConfig config, bool bf16_autocast, ErasedRun run);
  ~TrainerCore();
  TrainerCore(const TrainerCore&) = delete;
  TrainerCore& operator=(const TrainerCore&) = delete;
  TrainerCore(TrainerCore&&) = delete;
  TrainerCore& operator=(TrainerCore&&) = delete;

  TrainResult train();
  /// One step without logging (what train() does per step); for tests and custom loops.
  StepResult step(int64_t step);
  EventBus& events();
  [[nodiscard]] const DeviceMesh& mesh() const;
  [[nodiscard]] const std::shared_ptr<torch::nn::Module>& model() const;

 private:
  struct Impl;
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
    detail::check_trainable_plan<Plan>();
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
    if constexpr (model_provider<ModelProvider> && dataset_provider<DatasetProvider>) {
      build(std::move(context), std::move(models), std::move(datasets), std::move(task),
            std::move(config));
    }
  }

  /// Runs the configured number of steps (collective over all ranks).
  TrainResult train() { return core_->train(); }
  /// Subscribes to a typed event (d9d/train/events.hpp).
  template <class E>
  void on(std::function<void(const E&)> handler) {
    core_->events().template on<E>(std::move(handler));
  }
  [[nodiscard]] const DeviceMesh& mesh() const { return core_->mesh(); }
  [[nodiscard]] detail::TrainerCore& core() { return *core_; }

 private:
  template <class ModelProvider, class DatasetProvider, class Task>
  void build(DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
             TrainerConfig config) {
    using Model = model_of_t<ModelProvider>;
    using Dataset = dataset_of_t<DatasetProvider>;
    using Batch = batch_of_t<DatasetProvider>;
    static_assert(train_task_opts_in<Task>,
                  "d9d::Trainer: the task does not opt in. Fix: declare "
                  "`using train_task_concept = d9d::train_task_tag;` in it");
    static_assert(train_task_computes_loss<Task, Model, Batch>,
                  "d9d::Trainer: the task needs `d9d::LossOutput compute_loss(Model&, const "
                  "Batch&)` for the provider's model and the dataset's batch type");
    if constexpr (train_task<Task, Model, Batch>) {
      // Checked before anything is allocated: the mesh against the world, the batch against it.
      const MeshShape shape = resolve_mesh<typename Plan::mesh>(context.world_size(), config.mesh);
      detail::check_replicate_mesh(shape);
      auto mesh = std::make_shared<const DeviceMesh>(context, shape);
      const int dp = mesh->size(MeshDomain::batch, "dp");
      config.check_against_data_parallel(dp);

      torch::manual_seed(config.run.seed);  // the same initialisation on every rank
      Model model = models.build(ModelBuildContext{
          .device = context.device(), .mesh = mesh.get(), .config_json = config.section("model")});
      auto dataset = std::make_shared<Dataset>(
          datasets.build(DataBuildContext{.sequence_length = config.batch.sequence_length,
                                          .seed = config.run.seed,
                                          .dp_rank = mesh->coordinate(MeshDomain::batch, "dp"),
                                          .dp_size = dp,
                                          .config_json = config.section("data")}));

      detail::ErasedRun run;
      run.model = model.ptr();
      run.loss = [model, task = std::make_shared<Task>(std::move(task))](
                     const std::any& microbatch) mutable {
        return task->compute_loss(model, std::any_cast<const Batch&>(microbatch));
      };
      run.dataset_size = static_cast<int64_t>(dataset->size());
      run.load = [dataset](const std::vector<int64_t>& indices) -> std::any {
        return std::any(Batch(dataset->get(indices)));
      };
      run.split = [](const std::any& batch, int64_t parts) {
        std::vector<std::any> out;
        for (auto& part :
             split_batch(std::any_cast<const Batch&>(batch), static_cast<int>(parts))) {
          out.emplace_back(std::move(part));
        }
        return out;
      };
      if constexpr (requires { models.hf_config_json(); }) {
        run.hf_config_json = models.hf_config_json();
      }
      core_ = std::make_unique<detail::TrainerCore>(
          std::move(context), std::move(mesh), std::move(config),
          detail::uses_bf16_autocast<Plan>(), std::move(run));
    }
  }

  std::unique_ptr<detail::TrainerCore> core_;
};

}  // namespace d9d
