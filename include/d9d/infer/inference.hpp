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
// at-least-once). Under a pipeline plan every rank builds its stage (one per pp rank) and the
// executor runs the forward-only program (d9d::pipeline::Inference, with its sends and receives)
// over the microbatches; the task gives `at::Tensor stage_input(const Batch&)` and `at::Tensor
// output(const at::Tensor& last_stage_output, const Batch&)` instead of infer, and the last stage's
// ranks call the sink.
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
#include <d9d/parallel/parallelize.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/program.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/detail/build.hpp>
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
  /// Under a pipeline plan: the first stage's input (tokens[:, :-1]) and the rows from the last
  /// stage's logits.
  at::Tensor stage_input(const CausalLmBatch& batch);
  at::Tensor output(const at::Tensor& logits, const CausalLmBatch& batch);
};

namespace detail {

/// The user's data and task behind type erasure, so the loop is compiled once.
struct ErasedInference {
  int64_t dataset_size = 0;
  std::function<std::any(const std::vector<int64_t>&)> load;
  std::function<std::vector<std::any>(const std::any&, int64_t)> split;
  /// One step's microbatches -> this rank's rows [samples, ...], in sample order; undefined on a
  /// rank without outputs (a pipeline rank that does not hold the last stage).
  std::function<at::Tensor(const std::vector<std::any>&)> step;
  std::unique_ptr<parallel::ParallelModel> parallel;
  std::shared_ptr<pipeline::Executor> executor;  ///< pipeline plans
};

/// The executor of a forward-only program over this rank's stages (activations in the stages'
/// parameter dtype).
std::shared_ptr<pipeline::Executor> make_inference_executor(
    const DeviceMesh& mesh, const pipeline::Program& program,
    const std::vector<std::pair<std::shared_ptr<torch::nn::Module>, pipeline::Stage>>& stages,
    std::function<pipeline::TensorSpec(int)> activation);

/// The loop (src/infer/inference.cpp).
InferenceResult run_inference(const DistributedContext& context, const DeviceMesh& mesh,
                              const TrainerConfig& config, bool bf16_autocast, ErasedInference& run,
                              const InferenceSink& sink);

}  // namespace detail

/// The forward-only loop of `Plan` (see the file comment).
template <class Plan>
class Inference {
 public:
  template <class ModelProvider, class DatasetProvider, class Task>
  Inference(DistributedContext context, ModelProvider models, DatasetProvider datasets, Task task,
            TrainerConfig config, InferenceSink sink)
      : context_(std::move(context)), config_(std::move(config)), sink_(std::move(sink)) {
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
    if constexpr (kPipelined) {
      static_assert(
          requires(Task & t, const Batch& b, const at::Tensor& out) {
            { t.stage_input(b) } -> std::convertible_to<at::Tensor>;
            { t.output(out, b) } -> std::convertible_to<at::Tensor>;
          },
          "d9d::Inference: a pipeline plan needs the task's `at::Tensor stage_input(const Batch&)` "
          "(the first stage's input) and `at::Tensor output(const at::Tensor& last_stage_output, "
          "const Batch&)` (one row per sample)");
      static_assert(model_provider_builds_stages<ModelProvider>,
                    "d9d::Inference: a pipeline plan needs the model provider's `build_stage(const "
                    "d9d::StageBuildContext&)` (d9d::Qwen3Provider has it)");
    } else {
      static_assert(
          requires(Task & t, Model & m, const Batch& b) {
            { t.infer(m, b) } -> std::convertible_to<at::Tensor>;
          },
          "d9d::Inference: the task needs `at::Tensor infer(Model&, const Batch&)` giving one row "
          "per sample of the batch");
    }
    if (config_.checkpoint.init_from.empty()) {
      throw ConfigError(
          "d9d config: inference needs the model's weights. Fix: set \"checkpoint\": "
          "{\"init_from\": \"<Hugging Face checkpoint directory, e.g. runs/x/model>\"}");
    }
    mesh_ = detail::make_plan_mesh<Plan>(context_, config_);

    auto shared_task = std::make_shared<Task>(std::move(task));
    if constexpr (kPipelined) {
      build_stages<ModelProvider, Batch>(models, shared_task);
    } else {
      torch::manual_seed(config_.run.seed);
      Model model = models.build(ModelBuildContext{.device = context_.device(),
                                                   .mesh = mesh_.get(),
                                                   .config_json = config_.section("model")});
      run_.parallel = parallel::parallelize<Plan>(
          *mesh_, {model.ptr()},
          {.reshard = config_.data_parallel.reshard, .seed = config_.run.seed});
      run_.step = [model, shared_task](const std::vector<std::any>& microbatches) mutable {
        std::vector<at::Tensor> rows;
        for (const auto& microbatch : microbatches) {
          rows.push_back(shared_task->infer(model, std::any_cast<const Batch&>(microbatch)));
        }
        return at::cat(rows, 0);
      };
    }
    detail::load_init_from(context_, *run_.parallel, config_.checkpoint.init_from,
                           detail::hf_load_mapper_of(models), "inference weights");

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
  static constexpr bool kPipelined = detail::is_pipelined_v<Plan>;

  // One stage per pp rank (the forward-only program; any split loads by name), parallelized with
  // the Plan, and the executor over them.
  template <class ModelProvider, class Batch, class Task>
  void build_stages(ModelProvider& models, const std::shared_ptr<Task>& task) {
    const int pp = mesh_->size(MeshDomain::regular, "pp");
    const int dp = mesh_->size(MeshDomain::batch, "dp");
    const auto microbatches = static_cast<int>(config_.microbatches_per_step(dp));
    const auto program = pipeline::build_program<pipeline::Inference<>>(pp, microbatches);
    detail::require_sequence_length(config_);
    auto built = detail::build_rank_stages(models, context_, *mesh_, config_, program);
    run_.parallel = parallel::parallelize<Plan>(
        *mesh_, built.modules(),
        {.reshard = config_.data_parallel.reshard, .pipelined = true, .seed = config_.run.seed});
    run_.executor =
        detail::make_inference_executor(*mesh_, program, built.stages, std::move(built.activation));
    run_.step = [executor = run_.executor, task](const std::vector<std::any>& microbatches) {
      std::vector<at::Tensor> inputs;
      for (const auto& microbatch : microbatches) {
        inputs.push_back(task->stage_input(std::any_cast<const Batch&>(microbatch)));
      }
      const auto result = executor->run(inputs, {});
      if (result.outputs.empty()) {
        return at::Tensor();
      }
      std::vector<at::Tensor> rows;
      for (std::size_t i = 0; i < microbatches.size(); ++i) {
        rows.push_back(
            task->output(result.outputs[i], std::any_cast<const Batch&>(microbatches[i])));
      }
      return at::cat(rows, 0);
    };
  }

  DistributedContext context_;
  TrainerConfig config_;
  InferenceSink sink_;
  std::shared_ptr<const DeviceMesh> mesh_;
  detail::ErasedInference run_;
};

}  // namespace d9d
