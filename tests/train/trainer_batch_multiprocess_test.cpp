// Trainer<Plan> with a user batch that is a plain aggregate, on 2 data-parallel ranks: every
// microbatch the task receives holds exactly its rows (microbatch_size of them, this rank's share
// of the step in order), and over the ranks each sample of the step's global batch is seen once.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <d9d/core/collectives.hpp>
#include <d9d/data/sampler.hpp>
#include <d9d/testing/multiprocess.hpp>
#include <d9d/train/trainer.hpp>

#include "tests/core/core_test_util.hpp"

namespace {

constexpr int64_t kSamples = 32;
constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kMicrobatch = 2;
constexpr int64_t kSteps = 3;

// A plain aggregate: no Hana adaptation, no sequence length.
struct RowsBatch {
  at::Tensor x;    // float [n, 2], row i = (id, id)
  at::Tensor ids;  // int64 [n]
  int64_t tag = 42;
};

class Rows {
 public:
  [[nodiscard]] int64_t size() const { return kSamples; }
  [[nodiscard]] RowsBatch get(const std::vector<int64_t>& indices) const {
    const auto ids = at::tensor(indices, at::kLong);
    return {.x = ids.to(at::kFloat).unsqueeze(1).expand({-1, 2}).contiguous(), .ids = ids};
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

// Records the ids of every microbatch it is given.
struct RecordingTask {
  using train_task_concept = d9d::train_task_tag;
  std::shared_ptr<std::vector<std::vector<int64_t>>> seen =
      std::make_shared<std::vector<std::vector<int64_t>>>();
  d9d::LossOutput compute_loss(torch::nn::Linear& model, const RowsBatch& batch) const {
    EXPECT_EQ(batch.tag, 42);
    EXPECT_TRUE(at::equal(batch.x.select(1, 0).to(at::kLong), batch.ids));  // rows stay whole
    const auto ids = batch.ids.contiguous();
    seen->emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    const auto out = model->forward(batch.x.to(model->weight.device()));
    return {.loss_sum = out.square().sum(),
            .weight = at::scalar_tensor(static_cast<double>(ids.numel()), out.options())};
  }
};

TEST(Trainer_AggregateBatch_Gloo_ws2, EachMicrobatchAndRankReceivesExactlyItsRows) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](d9d::testing::RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto cfg = d9d::TrainerConfig::from_json_text(
        R"({"run": {"output_dir": ")" + env.scratch_dir() + "/rank" + std::to_string(env.rank()) +
        R"(", "total_steps": )" + std::to_string(kSteps) +
        R"(, "seed": 3}, "batch": {"global_batch_size": )" + std::to_string(kGlobalBatch) +
        R"(, "microbatch_size": )" + std::to_string(kMicrobatch) +
        R"(}, "logging": {"progress": false, "jsonl": false, "tensorboard": false},
           "export": {"enabled": false}, "checkpoint": {"resume": false}})");
    RecordingTask task;
    const auto seen = task.seen;
    using Plan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::parallel::Replicate>;
    d9d::Trainer<Plan> trainer(ctx, LinearProvider{}, RowsProvider{}, task, cfg);
    (void)trainer.train();

    const int64_t per_rank = kGlobalBatch / 2;
    const int64_t microbatches = per_rank / kMicrobatch;
    ASSERT_EQ(static_cast<int64_t>(seen->size()), kSteps * microbatches);
    d9d::data::DistributedSampler sampler(
        {.num_samples = kSamples, .dp_rank = env.rank(), .dp_size = 2, .seed = 3});
    for (int64_t step = 0; step < kSteps; ++step) {
      // This rank's share of the step, split in order into microbatches of exactly 2 rows.
      const auto share = sampler.batch(step, per_rank);
      std::vector<int64_t> received;
      for (int64_t m = 0; m < microbatches; ++m) {
        const auto& part = (*seen)[static_cast<std::size_t>(step * microbatches + m)];
        EXPECT_EQ(static_cast<int64_t>(part.size()), kMicrobatch) << "step " << step;
        received.insert(received.end(), part.begin(), part.end());
      }
      EXPECT_EQ(received, share) << "step " << step;
      // Over both ranks: each sample of the global batch exactly once.
      auto counts = at::zeros({kSamples}, at::kLong);
      for (const int64_t id : received) {
        counts[id] += 1;
      }
      counts = d9d::all_reduce(ctx.world(), counts.to(ctx.world().device())).cpu();
      EXPECT_EQ(counts.sum().item<int64_t>(), kGlobalBatch) << "step " << step;
      EXPECT_EQ(counts.max().item<int64_t>(), 1) << "step " << step;
    }
  });
}

}  // namespace
