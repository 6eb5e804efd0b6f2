// d9d/train/run_log.cpp — the trainer's logging pass (d9d/train/detail/run_log.hpp).
#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <d9d/optim/lr_schedule.hpp>
#include <d9d/track/svg.hpp>
#include <d9d/train/detail/run_log.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/format.hpp>

namespace d9d::detail {

int64_t last_untimed_step(const TrainerConfig& config, int64_t start_step) {
  const int64_t graphed = config.cuda_graphs.enabled
                              ? start_step + std::max<int64_t>(config.cuda_graphs.warmup_steps, 0)
                              : start_step;
  return graphed + 1 < config.run.total_steps ? graphed : start_step;
}

namespace {

// "logging.pictures": the learning rate of every step of the run and the loss of every step run,
// as SVG line charts next to metrics.jsonl (main rank). Returns the two paths.
std::pair<std::string, std::string> write_pictures(const TrainerConfig& cfg,
                                                   const TrainResult& result) {
  const auto schedule = optim::PiecewiseSchedule::build(cfg.lr_schedule, cfg.run.total_steps);
  track::ChartSeries lr{.label = "", .x = {}, .y = {}};
  for (int64_t step = 0; step < cfg.run.total_steps; ++step) {
    lr.y.push_back(cfg.optimizer.lr * schedule.multiplier(step));
  }
  track::ChartSeries loss{.label = "", .x = {}, .y = result.losses};
  for (std::size_t i = 0; i < result.losses.size(); ++i) {
    loss.x.push_back(static_cast<double>(result.start_step + static_cast<int64_t>(i)));
  }
  const auto lr_path = files::join(cfg.run.output_dir, "lr_schedule.svg");
  const auto loss_path = files::join(cfg.run.output_dir, "loss.svg");
  track::write_text_file(lr_path, track::line_chart({.title = "learning rate",
                                                     .x_label = "step",
                                                     .y_label = "lr",
                                                     .series = {std::move(lr)}}));
  track::write_text_file(loss_path, track::line_chart({.title = "training loss",
                                                       .x_label = "step",
                                                       .y_label = "loss",
                                                       .series = {std::move(loss)}}));
  return {lr_path, loss_path};
}

// The routers' balance metrics (d9d/parallel/moe_balance.cpp): the mean over layers, the worst
// layer, and one per layer.
constexpr std::string_view kBalance = "moe/load_max_over_mean";
constexpr std::string_view kBalanceWorst = "moe/load_max_over_mean_worst_layer";
constexpr std::string_view kBalanceLayer = "moe/load_max_over_mean/layer_";

// router_balance.svg: one thin curve per layer, the mean over layers and the worst layer on top.
std::string write_balance_picture(const TrainerConfig& cfg,
                                  std::map<std::string, track::ChartSeries> balance) {
  static constexpr std::array<const char*, 6> kLayerColours = {"#9ecae1", "#a1d99b", "#fdae6b",
                                                               "#bcbddc", "#fc9272", "#c7c7c7"};
  track::LineChart chart{.title = "router balance: most loaded expert / mean load (1 = balanced)",
                         .x_label = "step",
                         .y_label = "max / mean load",
                         .series = {},
                         .width = 800,
                         .height = 420};
  // line_chart draws the last series first, so the layers go under the worst layer and the mean.
  std::vector<track::ChartSeries> layers;
  for (auto& [name, series] : balance) {
    if (name.starts_with(kBalanceLayer)) {
      series.colour = kLayerColours.at(layers.size() % kLayerColours.size());
      layers.push_back(std::move(series));
    }
  }
  const auto add = [&](std::string_view name, std::string label, std::string colour) {
    if (const auto it = balance.find(std::string(name)); it != balance.end()) {
      it->second.label = std::move(label);
      it->second.colour = std::move(colour);
      chart.series.push_back(std::move(it->second));
    }
  };
  add(kBalance, "mean over " + std::to_string(layers.size()) + " layers", "#000000");
  add(kBalanceWorst, "worst layer", "#d62728");
  for (auto& series : layers) {
    chart.series.push_back(std::move(series));
  }
  const auto path = files::join(cfg.run.output_dir, "router_balance.svg");
  track::write_text_file(path, track::line_chart(chart));
  return path;
}

}  // namespace

RunLog::RunLog(const DistributedContext& context, const TrainerConfig& config, TrainResult& result)
    : context_(context), config_(config), main_(context.is_main_process()) {
  if (!main_) {
    return;
  }
  files::create_directories(config.run.output_dir);
  if (config.logging.progress) {
    progress_ = std::make_unique<util::ProgressBar>(config.run.total_steps, "train");
  }
  if (config.logging.jsonl) {
    result.metrics_path = files::join(config.run.output_dir, "metrics.jsonl");
    jsonl_ = std::make_unique<track::JsonlWriter>(result.metrics_path);
  }
  if (config.logging.tensorboard) {
    result.tensorboard_dir = files::join(config.run.output_dir, "tensorboard");
    tensorboard_ = std::make_unique<track::TensorBoardWriter>(result.tensorboard_dir);
  }
}

int64_t RunLog::samples_per_step() const { return config_.batch.global_batch_size; }
int64_t RunLog::tokens_per_step() const {
  return samples_per_step() * config_.batch.sequence_length;
}

void RunLog::start(const std::string& mesh, const std::string& step, int64_t microbatches) const {
  if (!main_) {
    return;
  }
  context_.logger().info("training " + std::to_string(config_.run.total_steps) + " steps on " +
                         std::to_string(context_.world_size()) + " rank(s), mesh " + mesh + step +
                         ", " + std::to_string(microbatches) + " microbatch(es) of " +
                         std::to_string(config_.batch.microbatch_size) + " per rank and step");
}

void RunLog::step(int64_t step, const StepResult& r, double seconds, bool logged,
                  const Scalars& extra) const {
  if (!main_) {
    return;
  }
  // Language models count tokens; a model without "batch.sequence_length" counts samples.
  const bool counts_tokens = tokens_per_step() > 0;
  const double rate =
      static_cast<double>(counts_tokens ? tokens_per_step() : samples_per_step()) / seconds;
  if (progress_) {
    progress_->update(step + 1, {{"loss", format::number(r.loss, "%.4f")},
                                 {"lr", format::number(r.lr, "%.2e")},
                                 {counts_tokens ? "tok/s" : "samples/s", util::format_si(rate)}});
  }
  if (!logged) {
    return;
  }
  Scalars scalars = {
      {"train/loss", r.loss},
      {"train/lr", r.lr},
      {"train/grad_norm", r.grad_norm},
      {counts_tokens ? "train/tokens_per_second" : "train/samples_per_second", rate}};
  scalars.insert(scalars.end(), extra.begin(), extra.end());
  if (config_.logging.pictures) {
    for (const auto& [name, value] : extra) {
      if (name.starts_with(kBalance)) {
        auto& series = balance_[name];
        series.x.push_back(static_cast<double>(step));
        series.y.push_back(value);
      }
    }
  }
  if (jsonl_) {
    jsonl_->write(step, scalars);
  }
  if (tensorboard_) {
    tensorboard_->add_scalars(step, scalars);
  }
}

void RunLog::finish(TrainResult& result) const {
  if (progress_) {
    progress_->finish();
  }
  if (tensorboard_) {
    tensorboard_->flush();
  }
  if (main_ && config_.logging.pictures) {
    std::tie(result.lr_schedule_svg, result.loss_svg) = write_pictures(config_, result);
    if (!balance_.empty()) {
      balance_svg_ = write_balance_picture(config_, balance_);
    }
  }
}

void RunLog::done(const TrainResult& result, bool config_json) const {
  if (!main_ || result.losses.empty()) {
    return;
  }
  const auto& log = context_.logger();
  log.info("done: " + std::to_string(result.steps) + " steps in " +
           format::number(result.seconds, "%.1f") + " s, loss " +
           format::number(result.losses.front(), "%.4f") + " -> " +
           format::number(result.losses.back(), "%.4f"));
  const std::array<std::pair<std::string, std::string>, 6> lines = {
      {{result.metrics_path, "metrics: " + result.metrics_path},
       {result.tensorboard_dir, "tensorboard: " + result.tensorboard_dir},
       {result.loss_svg, "pictures: " + result.lr_schedule_svg + ", " + result.loss_svg +
                             (balance_svg_.empty() ? "" : ", " + balance_svg_)},
       {result.export_dir,
        "model: " + result.export_dir +
            (config_json ? " (model.safetensors, config.json)" : " (model.safetensors)")},
       {result.adapter_dir,
        "adapter: " + result.adapter_dir + " (adapter_model.safetensors, adapter_config.json)"},
       {result.checkpoint_dir, "checkpoint: " + result.checkpoint_dir}}};
  for (const auto& [path, line] : lines) {
    if (!path.empty()) {
      log.info(line);
    }
  }
}

}  // namespace d9d::detail
