// d9d/train/trainer.cpp — the training loop: sampling, the step, and the passes around it
// (logging: run_log.cpp, profiling: profiler.cpp, checkpoints: checkpoints.cpp, numerics guards:
// numerics.cpp; the export is the step's own).
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <d9d/core/collectives.hpp>
#include <d9d/data/sampler.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/train/detail/checkpoints.hpp>
#include <d9d/train/detail/numerics.hpp>
#include <d9d/train/detail/profiler.hpp>
#include <d9d/train/detail/run_log.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

namespace d9d::detail {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

struct TrainerCore::Impl {
  Impl(DistributedContext context_in, std::shared_ptr<const DeviceMesh> mesh_in,
       TrainerConfig config_in, ErasedRun run_in, parallel::StepContributions::Share samples,
       int64_t microbatches_in)
      : context(std::move(context_in)),
        mesh(std::move(mesh_in)),
        config(std::move(config_in)),
        run(std::move(run_in)),
        checkpoints(*mesh, config),
        sampler(data::SamplerOptions{.num_samples = run.data.size,
                                     .dp_rank = samples.index,
                                     .dp_size = samples.count,
                                     .seed = config.run.seed}),
        per_rank_batch(config.batch.global_batch_size / samples.count),
        microbatches(microbatches_in) {}
  DistributedContext context;
  std::shared_ptr<const DeviceMesh> mesh;
  TrainerConfig config;
  ErasedRun run;
  EventBus events;
  CheckpointPass checkpoints;
  data::DistributedSampler sampler;
  int64_t per_rank_batch = 0;
  int64_t microbatches = 0;
  std::unique_ptr<StepCore> step;  ///< the one step of the plan (set by start)
  int64_t start_step = 0;          ///< > 0 when resumed from a checkpoint
  int64_t done_steps = 0;          ///< optimizer steps in the parameters now
};

TrainerCore::TrainerCore(DistributedContext context, std::shared_ptr<const DeviceMesh> mesh,
                         TrainerConfig config, ErasedRun run,
                         parallel::StepContributions::Share samples, int64_t microbatches)
    : impl_(std::make_unique<Impl>(std::move(context), std::move(mesh), std::move(config),
                                   std::move(run), samples, microbatches)) {
  // Enough data for one step, else a clear error.
  (void)impl_->sampler.steps_per_epoch(impl_->per_rank_batch);
}

TrainerCore::~TrainerCore() = default;

TrainStepOptions TrainerCore::step_options(const PrecisionOptions& precision) const {
  const auto& s = *impl_;
  TrainStepOptions options{.optimizer = s.config.optimizer,
                           .lr_schedule = s.config.lr_schedule,
                           .total_steps = s.config.run.total_steps,
                           .max_grad_norm = s.config.gradient_clipping.max_norm,
                           .seed = s.config.run.seed,
                           .events = &s.events,
                           .cuda_graphs = s.config.cuda_graphs.enabled,
                           .graph_warmup_steps = s.config.cuda_graphs.warmup_steps};
  precision.apply_to(options);
  if (const int64_t n = s.config.logging.pipeline_timeline_step; n > 0) {
    if (n > s.config.run.total_steps) {
      throw ConfigError(
          "d9d config: \"logging.pipeline_timeline_step\" = " + std::to_string(n) +
          " is past \"run.total_steps\" = " + std::to_string(s.config.run.total_steps) +
          ". Fix: a step from 1 to run.total_steps, or 0 for none");
    }
    options.timeline_step = n - 1;
    options.timeline_path = files::join(s.config.run.output_dir, "pipeline_timeline.svg");
  }
  return options;
}

void TrainerCore::start(std::unique_ptr<StepCore> step) {
  auto& s = *impl_;
  s.step = std::move(step);
  // Randomness after initialisation differs per rank (dropout and the like).
  torch::manual_seed(s.config.run.seed + 1 + static_cast<uint64_t>(s.context.rank()));
  s.start_step = s.checkpoints.resume(*s.step);
  if (s.checkpoints.resumed_from().empty() && !s.config.checkpoint.init_from.empty()) {
    load_init_from(s.context, s.step->parallel(), s.config.checkpoint.init_from,
                   s.run.hf_load_mapper, "initial weights",
                   /*stages_elsewhere=*/s.step->whole_model() == nullptr);
  }
}

std::string TrainerCore::save_checkpoint() {
  auto& s = *impl_;
  return s.checkpoints.save_now(std::max(s.done_steps, s.start_step), *s.step);
}

EventBus& TrainerCore::events() { return impl_->events; }
const DeviceMesh& TrainerCore::mesh() const { return *impl_->mesh; }
std::shared_ptr<torch::nn::Module> TrainerCore::model() const { return impl_->step->whole_model(); }
std::vector<std::shared_ptr<torch::nn::Module>> TrainerCore::modules() const {
  return impl_->step->modules();
}
parallel::ParallelModel& TrainerCore::parallel() { return impl_->step->parallel(); }
torch::optim::Optimizer& TrainerCore::optimizer() { return impl_->step->optimizer(); }

StepResult TrainerCore::step(int64_t step) {
  auto& s = *impl_;
  s.events.emit(events::StepStart{.step = step});
  const auto batch = s.run.data.load(s.sampler.batch(step, s.per_rank_batch));
  return s.step->run(s.run.data.split(batch, s.microbatches), step);
}

namespace {

// The scalars logged next to the loss at a logged step: the strategies' (e.g. the MoE routers'
// balance) and the task's metrics, synced over every rank (also kept in the result).
Scalars logged_metrics(TrainerCore::Impl& s, bool logged, TrainResult& result) {
  Scalars out;
  if (!logged) {
    return out;
  }
  for (auto& metric : s.step->parallel().metrics()) {
    out.push_back(std::move(metric));
  }
  if (s.run.metrics) {
    result.metrics.clear();
    for (const auto& [key, value] : s.run.metrics->synced()) {
      out.emplace_back("metrics/" + key, value);
      result.metrics["metrics/" + key] = value;
    }
  }
  return out;
}

// The end of the loop: pending checkpoints, timings, the peak memory over the ranks, the
// TrainEnd event, the log's last lines and the export.
void finish_run(TrainerCore::Impl& s, const RunLog& log, TrainResult& result,
                Clock::time_point start, Clock::time_point after_warmup, int64_t warmup_steps) {
  const auto& cfg = s.config;
  result.checkpoint_dir = s.checkpoints.finish();
  const auto end = Clock::now();
  result.start_step = s.start_step;
  result.resumed_from = s.checkpoints.resumed_from();
  result.steps = cfg.run.total_steps - s.start_step;
  result.seconds = seconds_between(start, end);
  const double timed = seconds_between(after_warmup, end);
  const int64_t timed_count = result.steps - warmup_steps;
  result.issue_seconds_per_step =
      timed_count > 0 ? result.issue_seconds_per_step / static_cast<double>(timed_count) : 0.0;
  if (timed_count > 0 && timed > 0) {
    const auto timed_steps = static_cast<double>(timed_count);
    result.tokens_per_second = static_cast<double>(log.tokens_per_step()) * timed_steps / timed;
    result.samples_per_second = static_cast<double>(log.samples_per_step()) * timed_steps / timed;
  }
  result.peak_memory_bytes = peak_memory(s.context.device());
  if (s.context.world_size() > 1) {
    const auto& world = s.context.world();
    const auto peak = at::tensor({static_cast<double>(result.peak_memory_bytes)}, at::kDouble);
    result.peak_memory_bytes = static_cast<int64_t>(
        all_reduce(world, peak.to(world.device()), ReduceOp::max).cpu().item<double>());
  }
  s.events.emit(events::TrainEnd{.steps = result.steps, .seconds = result.seconds});
  log.finish(result);
  if (cfg.export_model.enabled) {
    const auto exported = s.step->export_model(
        {.dir = files::join(cfg.run.output_dir, "model"),
         .adapter_dir = files::join(cfg.run.output_dir, "adapter"),
         .dtype = cfg.export_model.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat,
         .hf_config_json = s.run.hf_config_json,
         .mapper = s.run.hf_export_mapper});
    result.export_dir = exported.model_dir;
    result.adapter_dir = exported.adapter_dir;
  }
  log.done(result, !s.run.hf_config_json.empty());
}

}  // namespace

TrainResult TrainerCore::train() {
  auto& s = *impl_;
  const auto& cfg = s.config;
  TrainResult result;
  const RunLog log(s.context, cfg, result);
  log.start(s.mesh->shape().describe(), s.step->describe(), s.microbatches);
  NumericsGuard guard(cfg.numerics, cfg.run.total_steps, s.context);
  StepProfiler profiler(cfg.profile, s.context);
  reset_peak_memory(s.context.device());
  const auto start = Clock::now();
  // The rates are timed after the warm-up (the first step; with CUDA graphs also the capture).
  const int64_t last_untimed = last_untimed_step(cfg, s.start_step);
  auto after_warmup = start;
  for (int64_t step = s.start_step; step < cfg.run.total_steps; ++step) {
    const auto began = Clock::now();
    profiler.before(step);
    StepResult r;
    {
      RECORD_USER_SCOPE("d9d::step");
      r = this->step(step);
    }
    if (const auto trace = profiler.after(step); !trace.empty() && s.context.is_main_process()) {
      s.context.logger().info("profile: " + trace + " (steps " + std::to_string(cfg.profile.start) +
                              ".." + std::to_string(step) + ")");
    }
    // The task's metrics: their all-reduce starts now (every rank, at a step that is logged) and
    // is waited for when the step's record is written; the next window starts at once.
    const bool logged = step % cfg.run.log_every == 0 || step + 1 == cfg.run.total_steps;
    if (s.run.metrics && logged) {
      s.run.metrics->sync_start(s.context.world());
    }
    const auto verdict = guard.check(step, r, [&] { return s.checkpoints.kept(); });
    s.done_steps = step + 1;
    const double seconds = seconds_between(began, Clock::now());
    after_warmup = step == last_untimed ? Clock::now() : after_warmup;
    s.checkpoints.after_step(step + 1, *s.step);
    result.losses.push_back(r.loss);
    result.grad_norms.push_back(r.grad_norm);
    result.graph_replays += r.replayed_microbatches;
    result.issue_seconds_per_step += step > last_untimed ? r.issue_seconds : 0.0;
    if (verdict.skipped) {
      result.skipped_steps.push_back(step);
    }
    s.events.emit(events::StepEnd{.step = step,
                                  .loss = r.loss,
                                  .lr = r.lr,
                                  .grad_norm = r.grad_norm,
                                  .tokens = log.tokens_per_step(),
                                  .samples = log.samples_per_step(),
                                  .seconds = seconds});
    if (verdict.spike) {
      result.loss_spikes.push_back(step);
      s.events.emit(*verdict.spike);
    }
    log.step(step, r, seconds, logged, logged_metrics(s, logged, result));
  }
  finish_run(s, log, result, start, after_warmup, last_untimed - s.start_step + 1);
  return result;
}

}  // namespace d9d::detail
