// d9d/infer/inference.hpp — Inference<Plan>: a forward-only loop over a dataset with the training
// Plan's mesh, strategies and precision, its results handed to a sink.
//
//   auto cfg = d9d::TrainerConfig::from_file("infer.json");   // "checkpoint.init_from": the model
//   d9d::Inference<MyPlan> inference{ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{},
//                                    d9d::CausalLmScoreTask{}, cfg,
//                                    [](const std::vector<int64_t>& samples, const at::Tensor&
//                                    rows) {
//                                      // rows[i] belongs to dataset sample samples[i]
//                                    }};
//   d9d::InferenceResult result = inference.run();
//
// The constructor resolves the mesh, builds the model on every rank (same seed), parallelizes it
// with the Plan (d9d::parallel::parallelize: FullyShard gathers each block's parameters for its
// forward, TensorParallel splits heads and vocabulary), loads "checkpoint.init_from" (a Hugging
// Face checkpoint, e.g. the trainer's export; each rank reads only its slices) and builds the
// dataset. run() walks the dataset in order: step k covers samples [k G, (k + 1) G) of the global
// batch size G, data-parallel rank r the r-th contiguous share of it, in microbatches; the task's
// `at::Tensor infer(Model&, const Batch&)` gives one row per sample, without gradients and under
// the Plan's autocast. Each data-parallel rank whose tensor-parallel coordinate is 0 calls the sink
// with its samples' dataset indices and rows (the last step's padding dropped), so results are
// written where they are computed. After every step the main rank records the samples done in
// `<run.output_dir>/inference_progress.json`; a run started again over the same output directory
// continues after them (the sink may see the step that was in flight when a run stopped again:
// at-least-once). Pipeline plans are not supported yet (a compile-time error says so).
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/batch_tree.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/parallel/load.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/train_step.hpp>

namespace d9d {

/// Receives one data-parallel rank's results of one step: `samples[i]` is the dataset index of
/// row i of `rows` ([samples.size(), ...], on the model's device).
using InferenceSink =
    std::function<void(const std::vector<int64_t>& samples, const at::Tensor& rows)>;

/// What run() did (the same on every rank).
struct InferenceResult {
  int64_t samples = 0;     ///< dataset samples computed by this run (all ranks together)
  int64_t resumed_at = 0;  ///< samples done before it (from inference_progress.json)
  int64_t steps = 0;       ///< global batches run
  double seconds = 0.0;
  std::string progress_path;  ///< inference_progress.json (empty without run.output_dir)
};

/// A causal LM's per-sample scores: for each window of CausalLmBatch, row [sum of log p(token)
/// over tokens[1:], number of those tokens] (float64). Perplexity of a sample:
/// exp(-row[0] / row[1]).
class CausalLmScoreTask {
 public:
  at::Tensor infer(model::Qwen3ForCausalLM& model, const CausalLmBatch& batch);
};

namespace detail {

/// The user's data and task behind type erasure, so the loop is compiled once.
struct ErasedInference {
  int64_t dataset_size = 0;
  std::function<std::any(const std::vector<int64_t>&)> load;
  std::function<std::vector<std::any>(const std::any&, int64_t)> split;
  std::function<at::Tensor(const std::any&)> infer;  ///< one microbatch -> its rows
  std::unique_ptr<parallel::ParallelModel> parallel;
};

/// The loop (src/infer/inference.cpp).
InferenceResult run_inference(const DistributedContext& context, const DeviceMesh& mesh,
                              const TrainerConfig& config, bool bf16_autocast, ErasedInference& run,
                              const InferenceSink& sink);

/// "checkpoint.init_from" into the parallelized model (every rank its slices), through `mapper`
/// when given.
void load_inference_weights(
    const DistributedContext& context, parallel::ParallelModel& parallel,
    const TrainerConfig& config,
    const std::function<state::Mapper(const std::vector<std::string>&,
                                      const std::vector<std::string>&)>& mapper);

}  // namespace detail

/// The forward-only loop of `Plan` (see the file comment).
template <class Plan>
class Inference {
 public:
  template <class ModelProvider, class DatasetProvider, class Task>
  Inference(DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
            TrainerConfig config, InferenceSink sink)
      : context_(std::move(context)), config_(std::move(config)), sink_(std::move(sink)) {
    static_assert(!detail::is_pipelined_v<Plan>,
                  "d9d::Inference: pipeline plans are not supported yet. Fix: use the Plan "
                  "without its pipeline schedule (pp = 1) for inference");
    static_assert(model_provider<ModelProvider>,
                  "d9d::Inference: the model provider needs `using model_provider_concept = "
                  "d9d::model_provider_tag;` and `build(const d9d::ModelBuildContext&)`");
    static_assert(dataset_provider<DatasetProvider>,
                  "d9d::Inference: the dataset provider needs `using dataset_provider_concept = "
                  "d9d::dataset_provider_tag;` and `build(const d9d::DataBuildContext&)`");
    using Model = model_of_t<ModelProvider>;
    using Batch = batch_of_t<DatasetProvider>;
    static_assert(splittable_batch<Batch>,
                  "d9d::Inference: the dataset's batch type " D9D_UNSPLITTABLE_BATCH_FIX);
    static_assert(
        requires(Task & t, Model & m, const Batch& b) {
          { t.infer(m, b) } -> std::convertible_to<at::Tensor>;
        },
        "d9d::Inference: the task needs `at::Tensor infer(Model&, const Batch&)` giving one row "
        "per sample of the batch");
    if (config_.checkpoint.init_from.empty()) {
      throw ConfigError(
          "d9d config: inference needs the model's weights. Fix: set \"checkpoint\": "
          "{\"init_from\": \"<Hugging Face checkpoint directory, e.g. runs/x/model>\"}");
    }
    MeshShape shape;
    try {
      shape = resolve_mesh<typename Plan::mesh>(context_.world_size(), config_.mesh);
      detail::check_step_mesh<Plan>(shape);
    } catch (const ConfigError&) {
      throw;
    } catch (const std::invalid_argument& error) {
      throw ConfigError(std::string("d9d config: ") + error.what());
    }
    mesh_ = std::make_shared<const DeviceMesh>(context_, shape);
    config_.check_against_data_parallel(mesh_->size(MeshDomain::batch, "dp"));

    torch::manual_seed(config_.run.seed);
    Model model = models.build(ModelBuildContext{
        .device = context_.device(), .mesh = mesh_.get(), .config_json = config_.section("model")});
    run_.parallel = parallel::parallelize<Plan>(
        *mesh_, {model.ptr()},
        {.reshard = config_.data_parallel.reshard, .seed = config_.run.seed});
    std::function<state::Mapper(const std::vector<std::string>&, const std::vector<std::string>&)>
        mapper;
    if constexpr (requires(const std::vector<std::string>& keys) {
                    { models.hf_load_mapper(keys, keys) } -> std::convertible_to<state::Mapper>;
                  }) {
      mapper = [models](const std::vector<std::string>& source_keys,
                        const std::vector<std::string>& names) {
        return models.hf_load_mapper(source_keys, names);
      };
    }
    detail::load_inference_weights(context_, *run_.parallel, config_, mapper);

    using Dataset = dataset_of_t<DatasetProvider>;
    auto dataset = std::make_shared<Dataset>(
        datasets.build(DataBuildContext{.sequence_length = config_.batch.sequence_length,
                                        .seed = config_.run.seed,
                                        .dp_rank = mesh_->coordinate(MeshDomain::batch, "dp"),
                                        .dp_size = mesh_->size(MeshDomain::batch, "dp"),
                                        .config_json = config_.section("data"),
                                        .model_config_json = config_.section("model")}));
    run_.dataset_size = static_cast<int64_t>(dataset->size());
    run_.load = [dataset](const std::vector<int64_t>& indices) -> std::any {
      return std::any(Batch(dataset->get(indices)));
    };
    run_.split = [](const std::any& batch, int64_t parts) {
      std::vector<std::any> out;
      for (auto& part : split_batch(std::any_cast<const Batch&>(batch), static_cast<int>(parts))) {
        out.emplace_back(std::move(part));
      }
      return out;
    };
    run_.infer = [model, task = std::make_shared<Task>(std::move(task))](
                     const std::any& microbatch) mutable -> at::Tensor {
      return task->infer(model, std::any_cast<const Batch&>(microbatch));
    };
  }

  /// Runs over the dataset from where the output directory's progress says (collective).
  InferenceResult run() {
    try {
      return detail::run_inference(context_, *mesh_, config_,
                                   detail::precision_options<Plan>().bf16_autocast, run_, sink_);
    } catch (const std::exception& error) {
      context_.note_failure(error.what());
      throw;
    }
  }
  [[nodiscard]] const DeviceMesh& mesh() const { return *mesh_; }

 private:
  DistributedContext context_;
  TrainerConfig config_;
  InferenceSink sink_;
  std::shared_ptr<const DeviceMesh> mesh_;
  detail::ErasedInference run_;
};

}  // namespace d9d
