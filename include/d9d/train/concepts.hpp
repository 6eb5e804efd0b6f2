// d9d/train/concepts.hpp — what users implement: a model provider, a dataset provider, a task.
//
//   struct MyModel {
//     using model_provider_concept = d9d::model_provider_tag;           // the opt-in
//     d9d::model::Qwen3ForCausalLM build(const d9d::ModelBuildContext& ctx);
//   };
//   struct MyData { using dataset_provider_concept = d9d::dataset_provider_tag;
//                   MyDataset build(const d9d::DataBuildContext& ctx); };
//   struct MyTask { using train_task_concept = d9d::train_task_tag;
//                   d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& m, const Batch& b);
//                   };
//
// A task may also declare metrics (d9d/metrics/collection.hpp, library //src/metrics): the
// collection it logs, built once, and its per-microbatch update (train_task_declares_metrics):
//
//   d9d::metrics::MetricCollection metrics() const;
//   void update_metrics(const d9d::LossOutput& out, const Batch& b,
//                       d9d::metrics::MetricCollection& metrics) const;
//
// Each concept needs an explicit opt-in tag plus its operations (nothing satisfies one by
// accident), and its parts are named so a compiler error names the part that is missing.
#pragma once

#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/process_group.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/model/tensor_parallel.hpp>

namespace d9d {

struct TrainerConfig;

namespace detail {

/// Always true: written as `bool(requirement && detail::diagnostic("what is wrong. Fix: ..."))`, a
/// single atomic constraint whose text the compiler prints when it is not satisfied, so a
/// constrained function states its fix the way a static_assert would.
consteval bool diagnostic(const char* /*message*/) { return true; }

}  // namespace detail

/// Opt-in tags: a type declares `using model_provider_concept = d9d::model_provider_tag;` etc.
struct model_provider_tag {};
struct dataset_provider_tag {};
struct train_task_tag {};

/// What a model provider gets: where to build, the mesh, and its config section.
struct ModelBuildContext {
  c10::Device device = c10::Device(c10::kCPU);
  const DeviceMesh* mesh = nullptr;
  std::string config_json = "{}";  ///< the "model" section of the trainer config
};

/// What a model provider's build_stage gets under a pipeline plan: which stage of how many, and
/// the decoder layers it holds (d9d::model::distribute_layers over the stages).
struct StageBuildContext {
  c10::Device device = c10::Device(c10::kCPU);
  const DeviceMesh* mesh = nullptr;
  std::string config_json = "{}";  ///< the "model" section of the trainer config
  int stage = 0;                   ///< 0 .. stages - 1
  int stages = 1;                  ///< pp x stages per rank
  /// Tokens per sequence of the run's batches (0: unknown), for balancing the stages' costs
  /// (d9d::model::pipeline_virtual_layers).
  int64_t sequence_length = 0;
};

/// What a dataset provider gets: its config section and the run's sample shape and seed.
struct DataBuildContext {
  int64_t sequence_length = 0;
  uint64_t seed = 0;
  int dp_rank = 0;
  int dp_size = 1;
  std::string config_json = "{}";  ///< the "data" section of the trainer config
  /// The "model" section of the trainer config, for checks against the model (e.g. token ids
  /// below its "vocab_size"); "{}" when there is none.
  std::string model_config_json = "{}";
};

/// A microbatch's loss as a sum, and its weight (e.g. its number of target tokens): the reported
/// loss is sum(loss_sum) / sum(weight) over every microbatch of every data-parallel rank.
struct LossOutput {
  at::Tensor loss_sum;
  at::Tensor weight;
  /// Optional: what the model produced (e.g. the logits), for the task's update_metrics. Under a
  /// pipeline plan the trainer gives update_metrics the last stage's output when this is unset.
  /// (`{}`: initialisers that leave it out stay free of -Wmissing-field-initializers.)
  at::Tensor output{};  // NOLINT(readability-redundant-member-init)
};

/// A LibTorch module holder (what TORCH_MODULE defines): ptr() gives the module.
template <class M>
concept torch_module_holder = requires(M& m) {
  { m.ptr() } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
};

// ---- model provider --------------------------------------------------------------------------

template <class P>
concept model_provider_opts_in = requires {
  typename P::model_provider_concept;
}
&&std::derived_from<typename P::model_provider_concept, model_provider_tag>;

template <class P>
concept model_provider_builds_a_module = requires(P& p, const ModelBuildContext& ctx) {
  { p.build(ctx) } -> torch_module_holder;
};

/// Builds the model (on ctx.device) for this rank: opts in and has `build(ModelBuildContext)`
/// returning a module holder. Optionally `std::string hf_config_json()` for exports.
template <class P>
concept model_provider = model_provider_opts_in<P> && model_provider_builds_a_module<P>;

/// For pipeline plans: `build_stage(const StageBuildContext&)` returns a module holder whose
/// forward maps the stage's input tensor to its output (token ids to hidden states on the first
/// stage, hidden states to logits on the last), and whose module tells the sizes of both for a
/// microbatch without running (`input_sizes(batch, seq)`, `output_sizes(batch, seq)`; tensors
/// between stages are float32). Parameters keep the whole model's names.
template <class P>
concept model_provider_builds_stages = requires(P& p, const StageBuildContext& ctx) {
  { p.build_stage(ctx) } -> torch_module_holder;
  { p.build_stage(ctx)->forward(std::declval<const at::Tensor&>()) } -> std::same_as<at::Tensor>;
  {
    p.build_stage(ctx)->input_sizes(int64_t{1}, int64_t{1})
    } -> std::convertible_to<std::vector<int64_t>>;
  {
    p.build_stage(ctx)->output_sizes(int64_t{1}, int64_t{1})
    } -> std::convertible_to<std::vector<int64_t>>;
};

template <class P>
requires model_provider_builds_stages<P>
using stage_of_t =
    decltype(std::declval<P&>().build_stage(std::declval<const StageBuildContext&>()));

template <model_provider P>
using model_of_t = decltype(std::declval<P&>().build(std::declval<const ModelBuildContext&>()));

// ---- dataset provider ------------------------------------------------------------------------

template <class D>
concept sized_indexed_dataset = requires(D& d, const std::vector<int64_t>& indices) {
  { d.size() } -> std::convertible_to<int64_t>;
  d.get(indices);
};

template <class P>
concept dataset_provider_opts_in = requires {
  typename P::dataset_provider_concept;
}
&&std::derived_from<typename P::dataset_provider_concept, dataset_provider_tag>;

template <class P>
concept dataset_provider_builds_a_dataset = requires(P& p, const DataBuildContext& ctx) {
  { p.build(ctx) } -> sized_indexed_dataset;
};

/// Builds the dataset: opts in and has `build(DataBuildContext)` returning a dataset with
/// `size()` and `get(indices)`, the latter giving a batch tree (d9d/core/batch_tree.hpp).
template <class P>
concept dataset_provider = dataset_provider_opts_in<P> && dataset_provider_builds_a_dataset<P>;

template <dataset_provider P>
using dataset_of_t = decltype(std::declval<P&>().build(std::declval<const DataBuildContext&>()));

template <dataset_provider P>
using batch_of_t = std::remove_cvref_t<decltype(std::declval<dataset_of_t<P>&>().get(
    std::declval<const std::vector<int64_t>&>()))>;

// ---- train task ------------------------------------------------------------------------------

template <class T>
concept train_task_opts_in = requires {
  typename T::train_task_concept;
}
&&std::derived_from<typename T::train_task_concept, train_task_tag>;

template <class T, class Model, class Batch>
concept train_task_computes_loss = requires(T& t, Model& model, const Batch& batch) {
  { t.compute_loss(model, batch) } -> std::same_as<LossOutput>;
};

/// Turns a microbatch into a loss: opts in and has `compute_loss(Model&, const Batch&)`
/// returning d9d::LossOutput.
template <class T, class Model, class Batch>
concept train_task = train_task_opts_in<T> && train_task_computes_loss<T, Model, Batch>;

// ---- a train task's metrics (optional) --------------------------------------------------------

/// What the trainer does with a task's metrics: d9d::metrics::MetricCollection models it.
template <class C>
concept synced_metric_collection = requires(C& c, const ProcessGroup& group) {
  c.reset();
  c.sync_start(group);
  c.sync_wait();
  { c.compute_synced() } -> std::convertible_to<std::map<std::string, double>>;
};

/// The task declares metrics: `metrics()` builds the collection (called once, when the trainer is
/// built; every rank must build the same metrics in the same order).
template <class T>
concept train_task_declares_metrics = requires(const T& t) {
  t.metrics();
};

template <train_task_declares_metrics T>
using task_metrics_t = std::remove_cvref_t<decltype(std::declval<const T&>().metrics())>;

/// The task has a member named update_metrics (whatever its signature).
template <class T>
concept train_task_names_update_metrics = requires {
  &T::update_metrics;
};

/// The task's metrics, complete: `metrics()` returns a collection, and `update_metrics(const
/// LossOutput&, const Batch&, Collection&)` adds a microbatch to it (the trainer calls it after
/// each microbatch's loss, without gradients, on one rank per data share).
template <class T, class Batch>
concept train_task_updates_metrics = train_task_declares_metrics<T> &&
    synced_metric_collection<task_metrics_t<T>> &&
    requires(T& t, const LossOutput& out, const Batch& batch, task_metrics_t<T>& metrics) {
  t.update_metrics(out, batch, metrics);
};

/// For pipeline plans the model runs in stages, so the task splits its work in two: the first
/// stage's input of a microbatch (`stage_input(batch)`) and the loss of the last stage's output
/// (`output_loss(output, batch)`, a d9d::LossOutput as compute_loss returns).
template <class T, class Batch>
concept pipeline_train_task = requires(T& t, const Batch& batch, const at::Tensor& output) {
  { t.stage_input(batch) } -> std::same_as<at::Tensor>;
  { t.output_loss(output, batch) } -> std::same_as<LossOutput>;
};

/// This rank's part of every sequence when context parallelism splits them (index `index` of
/// `count`: the two chunks d9d::model::context_chunks names); whole when count is 1. The stages
/// cut their input themselves, so the last stage's output covers this part only: a pipeline
/// task's `output_loss(output, batch, part)` cuts its targets alike with part(labels, dim).
struct SequencePart {
  int index = 0;
  int count = 1;
  [[nodiscard]] bool whole() const { return count == 1; }
  /// This rank's chunks of `x` along `dim` (x itself when whole).
  [[nodiscard]] at::Tensor operator()(const at::Tensor& x, int64_t dim) const {
    return whole() ? x : model::context_shard(x, dim, index, count);
  }
};

/// The last pipeline stage's share of the vocabulary: under tensor parallelism, when the task takes
/// it (pipeline_task_takes_vocab_part), the stage's logits stay split ([..., V / tp], ids
/// [slice.start, slice.start + V / tp)) and cross_entropy_sum computes the loss-parallel
/// cross-entropy over the tp group, never gathering them; whole otherwise.
struct VocabPart {
  model::VocabSlice slice;
  [[nodiscard]] bool whole() const { return slice.whole(); }
  /// The summed cross-entropy of the rows of `logits` [N, V or V / tp] against the global ids
  /// `labels` [N] (ignore_index rows count nothing), at least in float32; the same value on every
  /// rank of the tp group, its gradient reaching this rank's logits only.
  [[nodiscard]] at::Tensor cross_entropy_sum(const at::Tensor& logits, const at::Tensor& labels,
                                             int64_t ignore_index) const;
};

/// A pipeline task that can take its part of a sequence split by context parallelism:
/// `output_loss(output, batch, part)` (d9d::CausalLmTask has it). Plans with ContextParallel and
/// a pipeline schedule need it (a start-up error otherwise).
template <class T, class Batch>
concept pipeline_task_takes_sequence_part = requires(T& t, const Batch& batch,
                                                     const at::Tensor& output,
                                                     const SequencePart& part) {
  { t.output_loss(output, batch, part) } -> std::same_as<LossOutput>;
};

/// A pipeline task that can take the last stage's logits split over the vocabulary:
/// `output_loss(output, batch, part, vocab)` (d9d::CausalLmTask has it). Under tensor parallelism
/// the step then keeps the logits split and the task computes the loss-parallel cross-entropy
/// (VocabPart::cross_entropy_sum); other tasks get the gathered logits.
template <class T, class Batch>
concept pipeline_task_takes_vocab_part = requires(T& t, const Batch& batch,
                                                  const at::Tensor& output,
                                                  const SequencePart& part,
                                                  const VocabPart& vocab) {
  { t.output_loss(output, batch, part, vocab) } -> std::same_as<LossOutput>;
};

}  // namespace d9d
