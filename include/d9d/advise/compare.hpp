// d9d/advise/compare.hpp — Plan variants measured side by side in one binary, each next to the
// advisor's prediction (docs/advise.md, "Comparing Plans").
//
//   using Replicated = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>>;
//   using Sharded = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>>;
//   const auto table = d9d::bench::compare<Replicated, Sharded>(
//       ctx, d9d::Qwen3Provider{}, d9d::TokenFilesProvider{}, d9d::CausalLmTask{}, config,
//       {.names = {"replicate", "fsdp"}, .warmup_steps = 2, .flops_per_token = f,
//        .peak_tflops = 989});
//   // the main rank prints one line per Plan under this header (docs/advise.md shows a run):
//   //   plan  tokens/s  tokens/s predicted  x first  MFU  peak memory  peak predicted
//   //         state held  state predicted
//
// Each Plan gets a Trainer<Plan> over the same provider, data, task and config (its output under
// config.run.output_dir/<name>), runs config.run.total_steps and is measured: tokens/s over the
// steps after `warmup_steps` (wall time of each step, events::StepEnd), MFU when the model FLOPs
// per token and the device's peak are given, the memory the most loaded rank allocated at once
// (the device allocator's peak; on the CPU the host bytes of the Plan's run, CpuMemoryMeter), and
// the parameter, gradient and AdamW-moment bytes the most loaded rank
// holds next to d9d::advise's prediction of them (d9d/advise/state_memory.hpp; Qwen3Provider's
// models and the Plans it predicts, else the reason it does not), and the advisor's state +
// activations of the fullest rank and, with a machine profile, its tokens/s
// (d9d/advise/preflight.hpp's predict_plan). Collective: every rank calls it
// with the same arguments; every rank gets the same table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <d9d/advise/memory_meter.hpp>
#include <d9d/advise/preflight.hpp>
#include <d9d/advise/state_memory.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>
#include <d9d/train/trainer.hpp>

namespace d9d::bench {

struct CompareOptions {
  /// One per Plan, in order; empty: "plan 1", "plan 2", ... Each names the table's row and the
  /// Plan's output directory (letters, digits, '-', '_' and '.' only).
  std::vector<std::string> names{};
  /// Steps excluded from the throughput (the first builds caches, graphs, communicators). Must be
  /// below config.run.total_steps.
  int64_t warmup_steps = 1;
  /// Model FLOPs per token of a training step (forward + backward), for MFU; 0: no MFU.
  double flops_per_token = 0;
  /// One device's peak TFLOP/s, for MFU; 0: no MFU.
  double peak_tflops = 0;
  /// The main rank writes the rows as JSON here ("": not written).
  std::string json_path{};
  /// The main rank prints the table on stdout.
  bool print = true;
  /// A machine profile (tools/gpu/profile-machine) to predict each Plan's step on: the
  /// "tokens/s predicted" column; null: none.
  const advise::MachineProfile* machine = nullptr;
  /// Per Plan, in order (shorter or empty: nothing for the rest): called on every rank right
  /// before that Plan's Trainer is built, with the config it will train (its output directory
  /// already its own). Variants of one Plan differ here: CUDA graphs, the microbatch, or a
  /// process-wide switch such as d9d::model::set_fused_kernels (which stays as the function
  /// leaves it, so give every Plan one when any sets it).
  std::vector<std::function<void(TrainerConfig&)>> configure{};
  /// The names (from `names`) of the Plans to run; empty: all. The others are compiled but not
  /// run and have no row; the ratios are to the first row.
  std::vector<std::string> only{};
};

/// One Plan's measurement and prediction.
struct PlanRow {
  std::string name{};
  int64_t timed_steps = 0;       ///< steps after the warm-up
  double tokens_per_second = 0;  ///< over all ranks, over the timed steps
  double ratio = 0;              ///< tokens_per_second / the first Plan's
  std::optional<double> mfu{};   ///< of flops_per_token at peak_tflops per rank; none without
  /// The most memory any rank had allocated at once: the device allocator's peak on an
  /// accelerator; on the CPU the host bytes the Plan's run (its trainer's construction included)
  /// allocated through LibTorch (d9d::advise::CpuMemoryMeter).
  int64_t peak_memory_bytes = 0;
  int64_t state_bytes = 0;  ///< parameters + gradients + AdamW moments, the most any rank holds
  std::optional<int64_t> predicted_state_bytes{};  ///< the advisor's, the most any rank holds
  std::string not_predicted{};  ///< why there is no prediction (empty when there is one)
  /// The advisor's peak of the fullest rank during a step (d9d::advise::predict_plan), where its
  /// activations are predicted: next to peak_memory_bytes, which also holds transient buffers.
  std::optional<int64_t> predicted_peak_bytes{};
  /// The advisor's tokens/s on CompareOptions::machine, where predicted.
  std::optional<double> predicted_tokens_per_second{};
  double first_loss = 0;  ///< the first step's loss
  double last_loss = 0;   ///< the last step's loss
  /// This rank's host time issuing a timed step's forward and backward, in ms
  /// (TrainResult::issue_seconds_per_step; 0 under pipeline Plans).
  double host_issue_ms = 0;
};

/// The rows of compare(), in the Plans' order.
struct Comparison {
  std::vector<PlanRow> rows{};

  /// The table the main rank prints: a header line, then one line per Plan.
  [[nodiscard]] std::string table() const;
  /// The rows as a JSON array of objects, keys as PlanRow's fields (null for an absent value).
  [[nodiscard]] std::string json() const;
};

namespace detail {

/// What one Plan's run measured on this rank, gathered from the trainer's events.
class PlanMeasure {
 public:
  explicit PlanMeasure(int64_t warmup_steps) : warmup_steps_(warmup_steps) {}
  void step_end(const events::StepEnd& e);
  /// At the optimizer of every step: this rank's gradient bytes then (the most over steps).
  void gradients(::d9d::detail::TrainerCore& core);

  [[nodiscard]] int64_t warmup_steps() const { return warmup_steps_; }
  [[nodiscard]] int64_t timed_steps() const { return timed_steps_; }
  [[nodiscard]] double timed_tokens() const { return timed_tokens_; }
  [[nodiscard]] double timed_seconds() const { return timed_seconds_; }
  [[nodiscard]] int64_t gradient_bytes() const { return gradient_bytes_; }
  [[nodiscard]] double first_loss() const { return first_loss_; }
  [[nodiscard]] double last_loss() const { return last_loss_; }

 private:
  int64_t warmup_steps_ = 0;
  int64_t steps_ = 0;
  int64_t timed_steps_ = 0;
  double timed_tokens_ = 0;
  double timed_seconds_ = 0;
  int64_t gradient_bytes_ = 0;
  double first_loss_ = 0;
  double last_loss_ = 0;
};

/// std::invalid_argument when `config` traces steps ("profile") on the CPU, where compare measures
/// the host memory through the profiler's slot (CpuMemoryMeter).
void refuse_profile_on_cpu(const TrainerConfig& config, const std::string& name);

/// The bytes of the parameters that do not train (a PEFT policy's frozen base) on this rank.
[[nodiscard]] int64_t frozen_parameter_bytes(::d9d::detail::TrainerCore& core);

/// This rank's parameter (frozen ones included) and AdamW-moment bytes after the run (gradients
/// come from PlanMeasure).
[[nodiscard]] advise::StateBytes held_state(::d9d::detail::TrainerCore& core,
                                            int64_t gradient_bytes);

/// The row from this rank's measurement: maxima over the world for the memory figures, the device
/// allocator's peak on an accelerator and `host_peak` (CpuMemoryMeter) on the CPU (collective).
[[nodiscard]] PlanRow finish_row(const DistributedContext& ctx, std::string name,
                                 const PlanMeasure& measure, const TrainResult& result,
                                 int64_t host_peak, const advise::StateBytes& held,
                                 const std::optional<advise::StateBytes>& predicted,
                                 std::string not_predicted, const CompareOptions& options);

/// Checks the options against the number of Plans and the config; the names (given or made).
[[nodiscard]] std::vector<std::string> checked_names(const CompareOptions& options,
                                                     std::size_t plans,
                                                     const TrainerConfig& config);

/// Whether the Plan named `name` runs (CompareOptions::only).
[[nodiscard]] bool selected(const CompareOptions& options, const std::string& name);

/// `config` with its output under `name`, then changed by the `index`-th Plan's
/// CompareOptions::configure where there is one.
[[nodiscard]] TrainerConfig plan_config(const TrainerConfig& config, const std::string& name,
                                        const CompareOptions& options, std::size_t index);

/// Ratios to the first row; prints and writes the JSON on the main rank.
void finish(const DistributedContext& ctx, Comparison& comparison, const CompareOptions& options);

/// The advisor's state prediction for this rank of `trainer`, or the reason it has none.
template <class Plan, class Provider>
std::pair<std::optional<advise::StateBytes>, std::string> predict_state(
    Trainer<Plan>& trainer, const TrainerConfig& config) {
  if constexpr (!std::is_same_v<std::decay_t<Provider>, Qwen3Provider>) {
    (void)trainer;
    (void)config;
    return {std::nullopt, "the advisor predicts Qwen3Provider's models only"};
  } else {
    try {
      const auto& mesh = trainer.core().mesh();
      const auto& shape = mesh.shape();
      const auto rules = advise::state_rules<Plan>(shape);
      const auto microbatches =
          static_cast<int>(config.batch.global_batch_size /
                           (config.batch.microbatch_size * shape.dp_replicate * shape.dp_shard));
      const auto parameters = advise::qwen3_rank_parameters<Plan>(
          model::Qwen3Config::from_json_text(config.sections.at("model")), shape,
          shape.pp > 1 ? mesh.coordinate(MeshDomain::regular, "pp") : 0, microbatches,
          config.batch.sequence_length);
      const int shard_rank =
          rules.shard_ranks > 1 ? mesh.coordinate(MeshDomain::dense, "dp_cp_shard") : 0;
      return {advise::state_bytes(parameters, rules, shard_rank), std::string()};
    } catch (const std::invalid_argument& e) {
      return {std::nullopt, e.what()};
    }
  }
}

template <class Plan, class Provider, class Dataset, class Task>
PlanRow run_plan(const DistributedContext& ctx, const std::string& name, std::size_t index,
                 const Provider& provider, const Dataset& dataset, const Task& task,
                 const TrainerConfig& config, const CompareOptions& options) {
  const auto plan_cfg = plan_config(config, name, options, index);
  // On the CPU the host memory of this Plan's run, from its construction (on a device its
  // allocator's peak). The meter holds this thread's profiler slot, which a traced run needs.
  std::optional<advise::CpuMemoryMeter> meter;
  if (ctx.device().is_cpu()) {
    refuse_profile_on_cpu(plan_cfg, name);
    meter.emplace();
  }
  Trainer<Plan> trainer(ctx, provider, dataset, task, plan_cfg);
  PlanMeasure measure(options.warmup_steps);
  trainer.template on<events::StepEnd>([&](const events::StepEnd& e) { measure.step_end(e); });
  trainer.template on<events::BeforeOptimizer>(
      [&](const events::BeforeOptimizer&) { measure.gradients(trainer.core()); });
  const auto result = trainer.train();
  const auto held = held_state(trainer.core(), measure.gradient_bytes());
  auto [predicted, why] = predict_state<Plan, Provider>(trainer, plan_cfg);
  auto row = finish_row(ctx, name, measure, result, meter ? meter->peak() : 0, held, predicted,
                        std::move(why), options);
  if constexpr (std::is_same_v<std::decay_t<Provider>, Qwen3Provider>) {
    try {
      const auto whole = advise::predict_plan(
          plan_cfg, advise::preflight_plan<Plan>(plan_cfg, trainer.core().mesh().shape()),
          options.machine, 0);
      row.predicted_peak_bytes = whole.peak_bytes;
      if (whole.time) {
        row.predicted_tokens_per_second = whole.time->tokens_per_second();
      }
    } catch (const std::invalid_argument&) {  // not_predicted already says why
    }
  }
  return row;
}

}  // namespace detail

/// Trains each of `Plans` in turn for config.run.total_steps over the same model, data and task and
/// returns (and on the main rank prints) one row per Plan: tokens/s, the ratio to the first Plan,
/// MFU, peak memory, and the state each rank holds next to the advisor's prediction (see the
/// file comment); CompareOptions::only runs some of them, CompareOptions::configure varies the
/// config per Plan. Collective over the world. std::invalid_argument for names that do not match
/// the Plans, `only` or `configure` that do not match the names, or a warm-up that leaves no timed
/// step.
template <class... Plans, class Provider, class Dataset, class Task>
Comparison compare(const DistributedContext& ctx, const Provider& provider, const Dataset& dataset,
                   const Task& task, const TrainerConfig& config,
                   const CompareOptions& options = {}) {
  static_assert(sizeof...(Plans) >= 1, "d9d::bench::compare needs at least one Plan");
  const auto names = detail::checked_names(options, sizeof...(Plans), config);
  Comparison comparison;
  std::size_t index = 0;
  const auto run_one = [&]<class Plan>(std::type_identity<Plan>) {
    if (detail::selected(options, names[index])) {
      comparison.rows.push_back(detail::run_plan<Plan>(ctx, names[index], index, provider, dataset,
                                                       task, config, options));
    }
    ++index;
  };
  (run_one(std::type_identity<Plans>{}), ...);
  detail::finish(ctx, comparison, options);
  return comparison;
}

}  // namespace d9d::bench
