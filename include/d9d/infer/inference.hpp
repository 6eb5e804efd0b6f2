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
#include <d9d/train/compose.hpp>
#include <d9d/train/concepts.hpp>
#include <d9d/train/config.hpp>

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

/// The loop (src/infer/inference.cpp): the steps over `data` in order, each through `step`.
InferenceResult run_inference(const DistributedContext& context, const DeviceMesh& mesh,
                              const TrainerConfig& config, bool bf16_autocast,
                              const ErasedData& data, ForwardStep& forward,
                              parallel::StepContributions::Share samples, int64_t microbatches,
                              const InferenceSink& sink);

/// The schedule Inference<Plan> composes with: the forward-only program under a pipeline plan,
/// else the plan's own (no pipeline).
template <class Plan>
using inference_schedule_t =
    std::conditional_t<plan_has_pipeline<Plan>, pipeline::Inference<>, typename Plan::pipeline>;

}  // namespace detail

/// The forward-only loop of `Plan` (see the file comment).
template <class Plan>
class Inference {
  using Schedule = detail::inference_schedule_t<Plan>;
  using Step = step_component<Schedule>;

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
    using Batch = batch_of_t<DatasetProvider>;
    static_assert(splittable_batch<Batch>,
                  "d9d::Inference: the dataset's batch type " D9D_UNSPLITTABLE_BATCH_FIX);
    static_assert(Step::template builds<ModelProvider>,
                  "d9d::Inference: a pipeline plan needs the model provider's `build_stage(const "
                  "d9d::StageBuildContext&)` (d9d::Qwen3Provider has it)");
    if (config_.checkpoint.init_from.empty()) {
      throw ConfigError(
          "d9d config: inference needs the model's weights. Fix: set \"checkpoint\": "
          "{\"init_from\": \"<Hugging Face checkpoint directory, e.g. runs/x/model>\"}");
    }
    auto composed = compose<Plan, Schedule>(context_, models, config_);
    mesh_ = composed.mesh;
    samples_ = composed.contributions.samples(*mesh_);
    microbatches_ = composed.microbatches;
    data_ = detail::erase_data<DatasetProvider, Batch>(datasets, *mesh_, composed.contributions,
                                                       config_);
    step_ = Step::template forward_step<Task, Batch, ModelProvider>(
        std::move(composed), std::make_shared<Task>(std::move(task)));
    detail::load_init_from(context_, *step_.parallel, config_.checkpoint.init_from,
                           detail::hf_load_mapper_of(models), "inference weights",
                           step_.stages_elsewhere);
  }

  /// Runs over the dataset from where the output directory's progress says (collective).
  InferenceResult run() {
    try {
      return detail::run_inference(context_, *mesh_, config_,
                                   detail::precision_options<Plan>().bf16_autocast, data_, step_,
                                   samples_, microbatches_, sink_);
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
  parallel::StepContributions::Share samples_;
  int64_t microbatches_ = 1;
  detail::ErasedData data_;
  ForwardStep step_;
};

}  // namespace d9d
