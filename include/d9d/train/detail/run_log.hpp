// d9d/train/detail/run_log.hpp — the trainer's logging pass (src/train/run_log.cpp): the start-up
// line, the progress bar, metrics.jsonl and TensorBoard per step, the pictures and the closing
// lines, all on the main rank. Not a public API.
//
//   RunLog log(context, config, result);       // opens the writers, sets result's paths
//   log.start(mesh_description, step_description, microbatches);
//   log.step(step, r, seconds, logged, scalars);
//   log.finish(result);  log.done(result, has_config_json);
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <d9d/core/distributed_context.hpp>
#include <d9d/track/jsonl.hpp>
#include <d9d/track/svg.hpp>
#include <d9d/track/tensorboard.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/step.hpp>
#include <d9d/util/progress.hpp>

namespace d9d {
struct TrainResult;
}  // namespace d9d

namespace d9d::detail {

using Scalars = std::vector<std::pair<std::string, double>>;

/// The last step of the run's warm-up; TrainResult's rates are timed over the steps after it: the
/// first step (lazy initialisation) and, with CUDA graphs, the eager warm-up steps and the step
/// that captures; the first step alone where no step would be left after the others.
[[nodiscard]] int64_t last_untimed_step(const TrainerConfig& config, int64_t start_step);

class RunLog {
 public:
  /// On the main rank: creates the output directory and the enabled writers, and puts their
  /// paths into `result`.
  RunLog(const DistributedContext& context, const TrainerConfig& config, TrainResult& result);

  /// The start-up line: steps, ranks, mesh, the step's description and the microbatches.
  void start(const std::string& mesh, const std::string& step, int64_t microbatches) const;
  /// A finished step: the progress bar; at logged steps, the loss, learning rate, gradient norm,
  /// rate and `extra` scalars (the strategies' and the task's metrics) to JSONL and TensorBoard.
  void step(int64_t step, const StepResult& r, double seconds, bool logged,
            const Scalars& extra) const;
  /// After the loop: the progress bar's last line, TensorBoard flushed, the pictures
  /// ("logging.pictures": learning rate and loss as SVG into `result`; for models with MoE layers
  /// router_balance.svg, every layer's max/mean expert load at the logged steps).
  void finish(TrainResult& result) const;
  /// The closing lines: steps, time, loss, and where everything went.
  void done(const TrainResult& result, bool config_json) const;

  /// Tokens per step (0 when the batch has no "sequence_length"), samples per step.
  [[nodiscard]] int64_t tokens_per_step() const;
  [[nodiscard]] int64_t samples_per_step() const;

 private:
  const DistributedContext& context_;
  const TrainerConfig& config_;
  bool main_;
  std::unique_ptr<util::ProgressBar> progress_;
  std::unique_ptr<track::JsonlWriter> jsonl_;
  std::unique_ptr<track::TensorBoardWriter> tensorboard_;
  // The routers' balance at the logged steps, by metric name: x the step, y the max/mean load.
  mutable std::map<std::string, track::ChartSeries> balance_;
  mutable std::string balance_svg_;
};

}  // namespace d9d::detail
