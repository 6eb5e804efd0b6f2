// A task's metrics in Trainer<Plan>, one process (d9d/train/concepts.hpp, train_task_declares_
// metrics): update_metrics runs once per microbatch, without gradients, on the microbatch's
// output and rows; each logged step writes the window since the previous log as "metrics/<name>"
// to metrics.jsonl and TensorBoard. Also the run's pictures (logging.pictures: lr_schedule.svg and
// loss.svg) and their config key.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <d9d/data/sampler.hpp>
#include <d9d/metrics/aggregation.hpp>
#include <d9d/metrics/collection.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/read_file.hpp"

namespace {

using ::testing::HasSubstr;

constexpr int64_t kSamples = 40;
constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kMicrobatch = 2;
constexpr int64_t kSteps = 5;  // log_every 2: steps 0, 2 and 4 are logged
constexpr uint64_t kSeed = 3;

struct RowsBatch {
  at::Tensor x;    // float [n, 2], row i = (id, 1)
  at::Tensor ids;  // int64 [n]
};

class Rows {
 public:
  [[nodiscard]] int64_t size() const { return kSamples; }
  [[nodiscard]] RowsBatch get(const std::vector<int64_t>& indices) const {
    const auto ids = at::tensor(indices, at::kLong);
    return {.x = at::stack({ids.to(at::kFloat) / 10.0, at::ones({ids.size(0)})}, 1), .ids = ids};
  }
};

struct RowsProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  [[nodiscard]] Rows build(const d9d::DataBuildContext& /*context*/) const { return {}; }
};

struct LinearProvider {
  using model_provider_concept = d9d::model_provider_tag;
  [[nodiscard]] torch::nn::Linear build(const d9d::ModelBuildContext& context) const {
    torch::nn::Linear model(2, 1);
    model->to(context.device);
    return model;
  }
};

// What update_metrics saw in one call.
struct Call {
  std::vector<int64_t> ids;
  std::vector<double> outputs;
  bool grad_mode = true;
};

struct MetricTask {
  using train_task_concept = d9d::train_task_tag;
  std::shared_ptr<std::vector<Call>> calls = std::make_shared<std::vector<Call>>();

  d9d::LossOutput compute_loss(torch::nn::Linear& model, const RowsBatch& batch) const {
    const auto out = model->forward(batch.x).squeeze(1);
    return {.loss_sum = out.square().sum(),
            .weight = at::scalar_tensor(static_cast<double>(out.size(0)), out.options()),
            .output = out};
  }
  [[nodiscard]] d9d::metrics::MetricCollection metrics() const {
    d9d::metrics::MetricCollection metrics;
    metrics.add("samples", d9d::metrics::Sum{});
    metrics.add("ids", d9d::metrics::Sum{});
    metrics.add("output", d9d::metrics::Mean{});
    return metrics;
  }
  void update_metrics(const d9d::LossOutput& out, const RowsBatch& batch,
                      d9d::metrics::MetricCollection& metrics) const {
    const auto ids = batch.ids.contiguous();
    const auto outputs = out.output.detach().to(at::kDouble).contiguous();
    calls->push_back(
        {.ids = {ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel()},
         .outputs = {outputs.data_ptr<double>(), outputs.data_ptr<double>() + outputs.numel()},
         .grad_mode = at::GradMode::is_enabled()});
    metrics.get<d9d::metrics::Sum>("samples").update(static_cast<double>(batch.ids.size(0)));
    metrics.get<d9d::metrics::Sum>("ids").update(batch.ids);
    metrics.get<d9d::metrics::Mean>("output").update(out.output);
  }
};

using Plan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::parallel::Replicate>;

std::string tmp_dir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");  // NOLINT(concurrency-mt-unsafe)
  const std::string dir = std::string(base != nullptr ? base : "/tmp") + "/" + name;
  d9d::files::remove_tree(dir);
  return dir;
}

d9d::TrainerConfig config(const std::string& dir, const std::string& logging) {
  return d9d::TrainerConfig::from_json_text(
      R"({"run": {"output_dir": ")" + dir + R"(", "total_steps": )" + std::to_string(kSteps) +
      R"(, "seed": )" + std::to_string(kSeed) +
      R"(, "log_every": 2}, "batch": {"global_batch_size": )" + std::to_string(kGlobalBatch) +
      R"(, "microbatch_size": )" + std::to_string(kMicrobatch) +
      R"(}, "optimizer": {"lr": 0.01},
         "lr_schedule": [{"steps": 2, "curve": "linear", "start": 0.1, "end": 1.0},
                         {"rest": true, "curve": "cosine", "start": 1.0, "end": 0.1}],
         "logging": )" +
      logging + R"(, "export": {"enabled": false}, "checkpoint": {"resume": false}})");
}

using d9d::testing::read_file;

TEST(Trainer_Metrics, UpdatedPerMicrobatchAndLoggedPerWindow) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto dir = tmp_dir("trainer_metrics");
  MetricTask task;
  const auto calls = task.calls;
  d9d::Trainer<Plan> trainer(
      ctx, LinearProvider{}, RowsProvider{}, task,
      config(dir, R"({"progress": false, "jsonl": true, "tensorboard": true, "pictures": false})"));
  const auto result = trainer.train();

  // One call per microbatch, in order, without gradients, on the microbatch's rows and output.
  constexpr int64_t kMicrobatches = kGlobalBatch / kMicrobatch;
  ASSERT_EQ(static_cast<int64_t>(calls->size()), kSteps * kMicrobatches);
  d9d::data::DistributedSampler sampler(
      {.num_samples = kSamples, .dp_rank = 0, .dp_size = 1, .seed = kSeed});
  for (int64_t step = 0; step < kSteps; ++step) {
    const auto batch = sampler.batch(step, kGlobalBatch);
    for (int64_t m = 0; m < kMicrobatches; ++m) {
      const auto& call = (*calls)[static_cast<std::size_t>(step * kMicrobatches + m)];
      EXPECT_FALSE(call.grad_mode) << "step " << step;
      EXPECT_EQ(call.ids, std::vector<int64_t>(batch.begin() + m * kMicrobatch,
                                               batch.begin() + (m + 1) * kMicrobatch))
          << "step " << step << " microbatch " << m;
      EXPECT_EQ(call.outputs.size(), static_cast<std::size_t>(kMicrobatch));
    }
  }

  // Each logged step holds the window since the previous logged step: [0], [1, 2], [3, 4].
  std::ifstream jsonl(result.metrics_path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(jsonl, line);) {
    lines.push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(lines.size(), 3U);
  const std::vector<std::pair<int64_t, int64_t>> windows = {{0, 0}, {1, 2}, {3, 4}};
  for (std::size_t w = 0; w < windows.size(); ++w) {
    const auto [first, last] = windows[w];
    double ids = 0;
    double outputs = 0;
    double count = 0;
    for (int64_t step = first; step <= last; ++step) {
      for (int64_t m = 0; m < kMicrobatches; ++m) {
        const auto& call = (*calls)[static_cast<std::size_t>(step * kMicrobatches + m)];
        for (std::size_t i = 0; i < call.ids.size(); ++i) {
          ids += static_cast<double>(call.ids[i]);
          outputs += call.outputs[i];
          count += 1;
        }
      }
    }
    const auto& line = lines[w];
    EXPECT_EQ(line.at("step").get<int64_t>(), last);
    EXPECT_EQ(line.at("metrics/samples").get<double>(),
              static_cast<double>(kGlobalBatch * (last - first + 1)));
    EXPECT_EQ(line.at("metrics/ids").get<double>(), ids) << "window " << w;
    EXPECT_NEAR(line.at("metrics/output").get<double>(), outputs / count,
                1e-12 * std::abs(outputs / count))
        << "window " << w;
    EXPECT_TRUE(line.contains("train/loss"));  // in the same record as the loss
  }
  // The result holds the last window's values; TensorBoard got the same tags.
  EXPECT_EQ(result.metrics.size(), 3U);
  EXPECT_EQ(result.metrics.at("metrics/samples"), lines.back().at("metrics/samples").get<double>());
  EXPECT_EQ(result.metrics.at("metrics/ids"), lines.back().at("metrics/ids").get<double>());
  const auto events = d9d::files::list_directory(result.tensorboard_dir);
  ASSERT_EQ(events.size(), 1U);
  const auto event_file = read_file(d9d::files::join(result.tensorboard_dir, events.front()));
  for (const char* tag : {"metrics/samples", "metrics/ids", "metrics/output", "train/loss"}) {
    EXPECT_NE(event_file.find(tag), std::string::npos) << tag;
  }
  EXPECT_TRUE(result.lr_schedule_svg.empty());  // "pictures": false
  EXPECT_FALSE(d9d::files::exists(dir + "/loss.svg"));
}

// ---- pictures ----------------------------------------------------------------------------------

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

// The number of points of the only polyline of `svg`.
std::size_t polyline_points(const std::string& svg) {
  EXPECT_EQ(count(svg, "<polyline"), 1U);
  const auto at = svg.find("points=\"", svg.find("<polyline"));
  const auto end = svg.find('"', at + 8);
  return count(svg.substr(at + 8, end - at - 8), ",");
}

TEST(Trainer_Pictures, LrScheduleAndLossCurveAsSvg) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto dir = tmp_dir("trainer_pictures");
  d9d::Trainer<Plan> trainer(
      ctx, LinearProvider{}, RowsProvider{}, MetricTask{},
      config(dir, R"({"progress": false, "jsonl": true, "tensorboard": false})"));
  const auto result = trainer.train();
  ASSERT_EQ(result.lr_schedule_svg, dir + "/lr_schedule.svg");
  ASSERT_EQ(result.loss_svg, dir + "/loss.svg");
  for (const auto& path : {result.lr_schedule_svg, result.loss_svg}) {
    const auto svg = read_file(path);
    EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0U) << path;
    EXPECT_EQ(count(svg, "</svg>"), 1U) << path;
    EXPECT_EQ(polyline_points(svg), static_cast<std::size_t>(kSteps)) << path;
  }
  EXPECT_THAT(read_file(result.loss_svg), HasSubstr(">training loss</text>"));
  EXPECT_THAT(read_file(result.lr_schedule_svg), HasSubstr(">learning rate</text>"));
}

TEST(Trainer_Pictures, ConfigKeyIsChecked) {
  try {
    (void)config("/tmp/unused", R"({"picture": false})");
    FAIL() << "no error";
  } catch (const d9d::ConfigError& error) {
    EXPECT_THAT(error.what(), HasSubstr(R"(unknown key "logging.picture" (did you mean )"
                                        R"("logging.pictures"?))"));
  }
  EXPECT_FALSE(config("/tmp/unused", R"({"pictures": false})").logging.pictures);
  EXPECT_TRUE(config("/tmp/unused", "{}").logging.pictures);
  // The pipeline timeline's step (its picture: train_multiprocess_test).
  EXPECT_EQ(config("/tmp/unused", "{}").logging.pipeline_timeline_step, 0);
  EXPECT_EQ(
      config("/tmp/unused", R"({"pipeline_timeline_step": 3})").logging.pipeline_timeline_step, 3);
  EXPECT_THROW((void)config("/tmp/unused", R"({"pipeline_timeline_step": -1})"), d9d::ConfigError);
}

}  // namespace
