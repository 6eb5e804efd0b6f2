// examples/06_classifier — Trainer<Plan> around a model, a dataset and a task of one's own: a
// small classifier of points drawn around class centres, with its metrics (accuracy, F1).
//
//   bazel build //examples/06_classifier
//   tools/d9drun -n 2 bazel-bin/examples/06_classifier/06_classifier
//       examples/06_classifier/classifier.json --output /tmp/classifier     (one command line)
//
// The reference for instantiating d9d::Trainer<Plan> in user code: a TORCH_MODULE model built by
// a model provider from the config's "model" section, a dataset provider whose batches are a
// plain struct (split into microbatches and data-parallel shares without any adaptation), a task
// that turns a microbatch into a loss sum and its weight and declares metrics (a confusion matrix
// updated per microbatch, synced over the ranks and logged as "metrics/cls/..." next to the
// loss), and main() under d9d::run_main, so a
// configuration mistake prints one error line per rank and exits with status 2 instead of
// aborting. No language-model settings: the config has no "batch.sequence_length", the progress
// line counts samples/s and the export writes model.safetensors only.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <d9d/core/collectives.hpp>
#include <d9d/d9d.hpp>
#include <d9d/metrics/collection.hpp>
#include <d9d/metrics/confusion_matrix.hpp>

// ---- configuration: one `using` per plan slot -------------------------------------------------
using Mesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;  // or d9d::mesh<d9d::dp_replicate<2>>
using DataParallel = d9d::parallel::Replicate;  // or d9d::parallel::FullyShard<> with dp_shard
using Precision = d9d::precision::Fp32;         // or d9d::precision::Bf16Mixed (GPU)
using ClassifierPlan = d9d::Plan<Mesh, DataParallel, Precision>;
// -----------------------------------------------------------------------------------------------

namespace {

// What the config's "model" section holds; unknown keys are errors, as in the trainer's sections.
struct Shape {
  int64_t features = 8;
  int64_t hidden = 32;
  int64_t classes = 4;

  static Shape from_json(const std::string& text) {
    Shape shape;
    const auto json = nlohmann::json::parse(text);
    for (const auto& [key, value] : json.items()) {
      int64_t* field = key == "features"  ? &shape.features
                       : key == "hidden"  ? &shape.hidden
                       : key == "classes" ? &shape.classes
                                          : nullptr;
      if (field == nullptr) {
        throw d9d::ConfigError("classifier config: unknown key \"model." + key +
                               "\". Fix: use features, hidden, classes");
      }
      if (!value.is_number_integer() || value.get<int64_t>() < 1) {
        throw d9d::ConfigError("classifier config: \"model." + key + "\" = " + value.dump() +
                               " must be an integer >= 1");
      }
      *field = value.get<int64_t>();
    }
    return shape;
  }
};

// ---- the model: a plain LibTorch module -------------------------------------------------------
struct ClassifierImpl : torch::nn::Module {
  explicit ClassifierImpl(const Shape& shape)
      : hidden(register_module("hidden", torch::nn::Linear(shape.features, shape.hidden))),
        output(register_module("output", torch::nn::Linear(shape.hidden, shape.classes))) {}
  at::Tensor forward(const at::Tensor& features) { return output(torch::relu(hidden(features))); }
  torch::nn::Linear hidden;
  torch::nn::Linear output;
};
TORCH_MODULE(Classifier);

struct ClassifierProvider {
  using model_provider_concept = d9d::model_provider_tag;
  Classifier build(const d9d::ModelBuildContext& context) const {
    Classifier model(Shape::from_json(context.config_json));
    model->to(context.device);
    return model;
  }
};

// ---- the data: points around one centre per class ---------------------------------------------
// A plain aggregate: split_batch reaches its tensors by position, no adaptation needed.
struct Batch {
  at::Tensor features;  // float32 [n, features]
  at::Tensor labels;    // int64 [n]
};

class Clusters {
 public:
  Clusters(int64_t samples, const Shape& shape, uint64_t seed) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto centres = at::randn({shape.classes, shape.features}, generator) * 3.0;
    labels_ = at::randint(shape.classes, {samples}, generator, at::kLong);
    features_ = centres.index_select(0, labels_) + at::randn({samples, shape.features}, generator);
  }
  [[nodiscard]] int64_t size() const { return labels_.size(0); }
  [[nodiscard]] Batch get(const std::vector<int64_t>& indices) const {
    const auto rows = at::tensor(indices, at::kLong);
    return {.features = features_.index_select(0, rows), .labels = labels_.index_select(0, rows)};
  }

 private:
  at::Tensor features_;
  at::Tensor labels_;
};

struct ClustersProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  Shape shape;
  Clusters build(const d9d::DataBuildContext& context) const {
    int64_t samples = 1024;
    const auto json = nlohmann::json::parse(context.config_json);  // outlives the loop
    for (const auto& [key, value] : json.items()) {
      if (key != "samples" || !value.is_number_integer() || value.get<int64_t>() < 1) {
        throw d9d::ConfigError("classifier config: \"data." + key + "\" = " + value.dump() +
                               " is not understood. Fix: \"data\": {\"samples\": N >= 1}");
      }
      samples = value.get<int64_t>();
    }
    // The same seed on every rank: every rank sees the same dataset, the sampler gives each its
    // share of it.
    return {samples, shape, 1000 + context.seed};
  }
};

// ---- the task: loss and metrics of one microbatch ---------------------------------------------
struct ClassifyTask {
  using train_task_concept = d9d::train_task_tag;
  int64_t classes = 4;

  d9d::LossOutput compute_loss(Classifier& model, const Batch& batch) const {
    const auto logits = model->forward(batch.features);
    const auto labels = batch.labels.to(logits.device());
    namespace F = torch::nn::functional;
    return {.loss_sum = F::cross_entropy(logits, labels,
                                         F::CrossEntropyFuncOptions().reduction(torch::kSum)),
            .weight = at::scalar_tensor(static_cast<double>(labels.size(0)), logits.options()),
            .output = logits};
  }

  // Built once by the trainer; logged as metrics/cls/accuracy, metrics/cls/f1_macro, ...
  [[nodiscard]] d9d::metrics::MetricCollection metrics() const {
    d9d::metrics::MetricCollection metrics;
    metrics.add("cls", d9d::metrics::ConfusionMatrix({.num_classes = classes}));
    return metrics;
  }
  // After each microbatch's loss, without gradients: the logits' argmax against the labels.
  void update_metrics(const d9d::LossOutput& out, const Batch& batch,
                      d9d::metrics::MetricCollection& metrics) const {
    metrics.get<d9d::metrics::ConfusionMatrix>("cls").update(out.output, batch.labels);
  }
};

// The accuracy of `model` over every sample, each rank scoring its strided share.
double evaluate(const d9d::DistributedContext& ctx, ClassifierImpl& model, const Clusters& data) {
  const at::NoGradGuard no_grad;
  std::vector<int64_t> mine;
  for (int64_t i = ctx.rank(); i < data.size(); i += ctx.world_size()) {
    mine.push_back(i);
  }
  const Batch batch = data.get(mine);
  auto counts = at::zeros({2}, at::kDouble);
  counts[0] = model.forward(batch.features.to(ctx.device()))
                  .argmax(1)
                  .cpu()
                  .eq(batch.labels)
                  .sum()
                  .item<double>();
  counts[1] = static_cast<double>(mine.size());
  if (ctx.world_size() > 1) {
    counts = d9d::all_reduce(ctx.world(), counts.to(ctx.world().device())).cpu();
  }
  return counts[0].item<double>() / counts[1].item<double>();
}

int run(int argc, char** argv) {
  CLI::App app{"Train a small classifier with d9d::Trainer (examples/06_classifier)"};
  std::string config_path;
  std::string output;
  double min_accuracy = 0.0;
  app.add_option("config", config_path, "trainer configuration (JSON)")->required();
  app.add_option("--output", output, "output directory, replacing run.output_dir");
  app.add_option("--min-accuracy", min_accuracy, "exit 3 when the final accuracy is lower");
  CLI11_PARSE(app, argc, argv);

  auto ctx = d9d::DistributedContext::from_env();
  auto cfg = d9d::TrainerConfig::from_file(config_path);  // d9d::ConfigError: run_main reports it
  if (!output.empty()) {
    cfg.run.output_dir = output;
    cfg.checkpoint.dir = output + "/checkpoints";
    cfg.profile.dir = output + "/profile";
  }
  const Shape shape = Shape::from_json(cfg.section("model"));
  d9d::Trainer<ClassifierPlan> trainer{ctx, ClassifierProvider{}, ClustersProvider{shape},
                                       ClassifyTask{.classes = shape.classes}, cfg};
  const d9d::TrainResult result = trainer.train();

  auto model = std::dynamic_pointer_cast<ClassifierImpl>(trainer.core().model());
  const Clusters data =
      ClustersProvider{shape}.build({.seed = cfg.run.seed, .config_json = cfg.section("data")});
  const double final_accuracy = evaluate(ctx, *model, data);
  ctx.logger().info_main(
      "accuracy " + std::to_string(final_accuracy) + " over " + std::to_string(data.size()) +
      " samples; loss " + std::to_string(result.losses.front()) + " -> " +
      std::to_string(result.losses.back()) + "; " +
      std::to_string(static_cast<int64_t>(result.samples_per_second)) +
      " samples/s; train accuracy " + std::to_string(result.metrics.at("metrics/cls/accuracy")) +
      ", macro F1 " + std::to_string(result.metrics.at("metrics/cls/f1_macro")) +
      " (the last logging window, all ranks)");
  return final_accuracy >= min_accuracy ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) { return d9d::run_main(argc, argv, run); }
