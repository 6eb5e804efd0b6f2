// Data-parallel and pipelined training on 2 and 4 ranks (Gloo) against a single-process run of the
// same global batch: losses and parameters must match (fp32, tight tolerance) over several steps.
#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/parallel/detail/embedding_rows.hpp>
#include <d9d/parallel/replicate.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::testing::RankEnv;
using ::testing::HasSubstr;

using d9d::testing::kLossRtol;
using d9d::testing::kParameterAtol;

using DpPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Fp64>;
using OneProcessPlan = d9d::Plan<d9d::precision::Fp64>;

class Train_Replicate : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(GetParam()); }
};

TEST_P(Train_Replicate, MatchesOneRankWithTheSameGlobalBatch) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/rank" + std::to_string(env.rank());
    // Global batch 8: 4 ranks x 1 microbatch of 2, or 2 ranks x 2 microbatches of 2.
    d9d::Trainer<DpPlan> distributed(ctx, d9d::Qwen3Provider{},
                                     d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                     d9d::testing::tiny_run(dir + "/dp", 6, 8, 2));
    EXPECT_EQ(distributed.mesh().size(d9d::MeshDomain::batch, "dp"), env.world_size());
    const auto result = distributed.train();

    // The reference: one process, the whole global batch, no communication.
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    d9d::Trainer<DpPlan> single(local, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{}, d9d::testing::tiny_run(dir + "/one", 6, 8, 8));
    const auto reference = single.train();

    ASSERT_EQ(result.losses.size(), reference.losses.size());
    for (std::size_t i = 0; i < result.losses.size(); ++i) {
      EXPECT_NEAR(result.losses[i], reference.losses[i], kLossRtol * std::abs(reference.losses[i]))
          << "step " << i;
    }
    const auto got = distributed.core().model()->named_parameters();
    const auto want = single.core().model()->named_parameters();
    for (const auto& item : want) {
      EXPECT_TRUE(at::allclose(got[item.key()], item.value(), 0.0, kParameterAtol))
          << item.key() << " max diff "
          << (got[item.key()] - item.value()).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Train_Replicate, ::testing::Values(2, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// A tied embedding under Replicate: the last microbatch's lookup gradient is added as rows after
// the weight's early all-reduce (data_parallel.tied_embedding_rows, on by default). One and two
// microbatches per rank; losses and parameters as one process's.
TEST(Train_Replicate_ws2, TiedEmbeddingRowsMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/rank" + std::to_string(env.rank());
    for (const int64_t global_batch : {4, 8}) {
      const auto run = [&](const d9d::DistributedContext& where, const std::string& name,
                           int64_t microbatch) {
        d9d::Trainer<DpPlan> trainer(
            where, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
            d9d::testing::tiny_run(dir + "/" + name + std::to_string(global_batch), 4, global_batch,
                                   microbatch, false, 2, "", /*tied=*/true));
        auto result = trainer.train();
        return std::make_pair(result.losses, trainer.core().model()->named_parameters());
      };
      const auto [losses, got] = run(ctx, "dp", 2);
      const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
      const auto [reference, want] = run(local, "one", global_batch);
      ASSERT_EQ(losses.size(), reference.size());
      for (std::size_t i = 0; i < losses.size(); ++i) {
        EXPECT_NEAR(losses[i], reference[i], kLossRtol * std::abs(reference[i]))
            << "global batch " << global_batch << " step " << i;
      }
      for (const auto& item : want) {
        EXPECT_TRUE(at::allclose(got[item.key()], item.value(), 0.0, kParameterAtol))
            << "global batch " << global_batch << " " << item.key();
      }
    }
  });
}

// A tiny Qwen3 on this rank's device and its loss on a sequence of the rank's own token (rank + 1),
// so that the ranks' gradients differ (the GradientReducer tests).
struct RankOwnLoss {
  d9d::model::Qwen3ForCausalLM model{
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json())};
  at::Tensor tokens;

  RankOwnLoss(const RankEnv& env, const d9d::DistributedContext& ctx) {
    model->to(ctx.device());
    tokens = at::randint(64, {2, 9}, at::kLong).to(ctx.device()) * 0 + env.rank() + 1;
  }
  at::Tensor operator()() {
    return d9d::model::causal_lm_loss(model(tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8))
        .loss_sum;
  }
};

// The reference the GradientReducer tests compare with: each of the first `count` parameters'
// gradient (this rank's own, from one plain backward) summed over `group`; the gradients are
// dropped, so the next backward starts from none.
std::vector<at::Tensor> own_gradients_summed(const d9d::ProcessGroup& group,
                                             const std::vector<at::Tensor>& params,
                                             std::size_t count) {
  std::vector<at::Tensor> sums;
  sums.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    sums.push_back(d9d::all_reduce(group, params[i].grad().clone()));
    params[i].mutable_grad() = at::Tensor();
  }
  return sums;
}

// The gradients zeroed in place (as the optimizer does when it keeps them), then two backwards,
// the second armed: each gradient should hold twice its single-backward sum.
void accumulate_twice_in_place(d9d::parallel::GradientReducer& reducer,
                               const std::vector<at::Tensor>& params, RankOwnLoss& loss_of) {
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1));
  optimizer.zero_grad(/*set_to_none=*/false);
  loss_of().backward();
  reducer.arm();
  loss_of().backward();
  reducer.finish();
}

TEST(Train_Replicate_ws2, BucketsAreReducedDuringBackward) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_replicate = 2});
    RankOwnLoss loss_of(env, ctx);
    std::vector<at::Tensor> params = loss_of.model->parameters();
    d9d::parallel::GradientReducer reducer(mesh.group(d9d::MeshDomain::batch, "dp"), params,
                                           {.bucket_bytes = 4096});
    ASSERT_GT(reducer.bucket_count(), 3U);
    // Each rank's own data; the reduced gradient is the sum of both ranks' gradients.
    loss_of().backward();  // this rank's own gradient, for the reference
    const auto sums =
        own_gradients_summed(mesh.group(d9d::MeshDomain::batch, "dp"), params, params.size());
    reducer.arm();
    loss_of().backward();
    // Every parameter got a dense gradient on the group's device: reduced where it is.
    std::vector<const void*> before;
    before.reserve(params.size());
    for (const auto& p : params) {
      before.push_back(p.grad().data_ptr());
    }
    reducer.finish();
    EXPECT_GT(reducer.launched_during_backward(), 0U);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].grad(), sums[i], 1e-5, 1e-6)) << "parameter " << i;
      EXPECT_EQ(params[i].grad().data_ptr(), before[i]) << "parameter " << i;
    }
    // Zeroed in place by the optimizer rather than dropped (it detaches them in place first, which
    // a view would refuse), they take the next backward's gradients and reduce again: twice the
    // same data, twice the sums.
    accumulate_twice_in_place(reducer, params, loss_of);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].grad(), sums[i] * 2, 1e-5, 1e-6)) << "parameter " << i;
    }
  });
}

TEST(Train_Replicate_ws2, ABucketWithAMissingGradientIsFlattenedWithZeros) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_replicate = 2});
    const auto group = mesh.group(d9d::MeshDomain::batch, "dp");
    RankOwnLoss loss(env, ctx);
    // One bucket for everything, with a parameter the loss never uses: the bucket is flattened
    // into one buffer, zeros standing for the missing gradient.
    const auto unused = at::ones({5}, at::TensorOptions().device(ctx.device())).requires_grad_();
    std::vector<at::Tensor> params = loss.model->parameters();
    params.push_back(unused);
    d9d::parallel::GradientReducer reducer(group, params, {.bucket_bytes = int64_t{1} << 30});
    ASSERT_EQ(reducer.bucket_count(), 1U);
    loss().backward();
    const auto sums = own_gradients_summed(group, params, params.size() - 1);
    reducer.arm();
    loss().backward();
    ASSERT_FALSE(unused.grad().defined());
    reducer.finish();
    EXPECT_EQ(reducer.launched_during_backward(), 0U);  // it waited for the unused one
    for (std::size_t i = 0; i + 1 < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].grad(), sums[i], 1e-5, 1e-6)) << "parameter " << i;
    }
    ASSERT_TRUE(unused.grad().defined());
    EXPECT_TRUE(at::equal(unused.grad(), at::zeros_like(unused)));
  });
}

// The reducer and the deferred lookup of a tied embedding, as Replicate runs them: the weight's
// bucket goes first and is launched before the backward reaches the first layer (without the
// deferral it waits for the lookup's backward, the last), and every rank's rows are added after
// the reduction, padded to the longest rank (rank 0 looks up 2 x 8 ids, rank 1 1 x 5): each
// gradient is the group's sum of the ranks' whole gradients either way.
TEST(Train_Replicate_ws2, ATiedEmbeddingIsReducedFirstAndItsRowsAddedAfter) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_replicate = 2});
    const auto group = mesh.group(d9d::MeshDomain::batch, "dp");
    d9d::model::Qwen3ForCausalLM model(
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(/*tied=*/true)));
    model->to(ctx.device());
    const int64_t sequences = env.rank() == 0 ? 2 : 1;
    const int64_t length = env.rank() == 0 ? 8 : 5;
    at::manual_seed(11 + env.rank());
    const auto tokens = at::randint(64, {sequences, length + 1}, at::kLong).to(ctx.device());
    const auto loss_of = [&] {
      return d9d::model::causal_lm_loss(model(tokens.narrow(1, 0, length)),
                                        tokens.narrow(1, 1, length))
          .loss_sum;
    };
    const std::vector<at::Tensor> params = model->parameters();
    loss_of().backward();
    const auto sums = own_gradients_summed(group, params, params.size());
    const auto weight = model->embedding_weight();
    auto rows = std::make_shared<d9d::parallel::detail::ReplicatedEmbeddingRows>(group, weight);
    model->set_embedding_row_sink(rows);
    d9d::parallel::GradientReducer reducer(group, params,
                                           {.bucket_bytes = 4096, .first = {weight}});
    ASSERT_GT(reducer.bucket_count(), 3U);
    // How many buckets were launched when the first layer's query weight got its gradient.
    std::size_t launched_at_first_layer = 0;
    auto query =
        model->model->layers[0]->as<d9d::model::Qwen3DecoderLayer>()->self_attn->q_proj->weight;
    query.register_hook([&](const at::Tensor& grad) {
      launched_at_first_layer = reducer.launched_during_backward();
      return grad;
    });
    for (const bool deferred : {true, false}) {
      if (deferred) {
        rows->begin();
      }
      const auto loss = loss_of();
      reducer.arm();
      loss.backward();
      reducer.finish();
      rows->finish();
      EXPECT_EQ(rows->deferred_lookups(), 1);
      if (deferred) {
        EXPECT_GE(launched_at_first_layer, 1U);
      } else {
        EXPECT_EQ(launched_at_first_layer, 0U);
      }
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i].grad(), sums[i], 1e-5, 1e-6))
            << (deferred ? "deferred" : "whole") << " parameter " << i;
      }
      for (const auto& p : params) {
        p.mutable_grad() = at::Tensor();
      }
    }
    // A lookup's gradient arriving after finish() would be lost: refused.
    EXPECT_THROW(rows->rows_backward(at::Tensor(), at::zeros({1, weight.size(1)})),
                 std::logic_error);
  });
}

// ReduceEngine::copy: on CPU groups (Gloo) a clear refusal; on GPUs (the NCCL run of this suite)
// the copy engines' sums equal the all-reduce's, each gradient becomes its place in the copy
// buffer (the same place every step), and gradients accumulated there in place reduce again.
TEST(Train_Replicate_ws2, TheCopyEngineSumsLikeTheAllReduce) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_replicate = 2});
    const auto group = mesh.group(d9d::MeshDomain::batch, "dp");
    RankOwnLoss loss_of(env, ctx);
    std::vector<at::Tensor> params = loss_of.model->parameters();
    const d9d::parallel::GradientReducerOptions options{
        .bucket_bytes = 4096, .engine = d9d::parallel::ReduceEngine::copy};
    // data_parallel.reduce_engine "auto": the copy engines for a CUDA group that is the whole job
    // on one node, without a pipeline (in a CUDA build); else the all-reduce.
    using d9d::parallel::ReduceEngine;
    const auto automatic = d9d::parallel::automatic_reduce_engine;
    EXPECT_EQ(automatic(group, 2, 2, false),
              ctx.device().is_cuda() ? ReduceEngine::copy : ReduceEngine::backend);
    EXPECT_EQ(automatic(group, 2, 1, false), ReduceEngine::backend);  // two nodes
    EXPECT_EQ(automatic(group, 4, 4, false), ReduceEngine::backend);  // a part of the job
    EXPECT_EQ(automatic(group, 2, 2, true), ReduceEngine::backend);   // a pipeline program
    if (!ctx.device().is_cuda()) {
      try {
        d9d::parallel::GradientReducer reducer(group, params, options);
        ADD_FAILURE() << "a CPU group accepted the copy engine";
      } catch (const std::invalid_argument& error) {
        EXPECT_THAT(error.what(), HasSubstr("reduce_engine \"copy\" needs a CUDA"));
        EXPECT_THAT(error.what(), HasSubstr("Fix: use reduce_engine \"backend\""));
      }
      return;
    }
    d9d::parallel::GradientReducer reducer(group, params, options);
    ASSERT_GT(reducer.bucket_count(), 3U);
    loss_of().backward();
    const auto sums = own_gradients_summed(group, params, params.size());
    std::vector<const void*> places;
    places.reserve(params.size());
    for (int step = 0; step < 2; ++step) {  // fresh gradients each step (the trainer drops them)
      for (auto& p : params) {
        p.mutable_grad() = at::Tensor();
      }
      reducer.arm();
      loss_of().backward();
      reducer.finish();
      EXPECT_GT(reducer.launched_during_backward(), 0U);
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i].grad(), sums[i], 1e-5, 1e-6))
            << "step " << step << " parameter " << i;
        if (step == 0) {
          places.push_back(params[i].grad().data_ptr());
        } else {
          EXPECT_EQ(params[i].grad().data_ptr(), places[i]) << "parameter " << i;
        }
      }
    }
    // Under a recording queue the model's linear layers run their own backward, whose weight
    // GEMMs write the step's first product at the weight's place in the copy buffer (design note
    // 0031): after the backward, before finish(), the projections' gradients are already there,
    // the norms' are not (autograd made them; the reducer copies them in); the sums stay the
    // all-reduce's.
    for (auto& p : params) {
      p.mutable_grad() = at::Tensor();
    }
    const auto named = loss_of.model->named_parameters();
    ASSERT_EQ(named.size(), params.size());
    d9d::WeightGradQueue queue;  // recording, never deferring
    reducer.arm();
    at::Tensor loss;
    {
      const d9d::RecordWeightGrads record(queue);
      loss = loss_of();
    }
    loss.backward();
    std::size_t projections = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& name = named[i].key();
      if (name.ends_with("_proj.weight")) {
        ++projections;
        EXPECT_EQ(params[i].grad().data_ptr(), places[i]) << name << ": written at its place";
      } else if (name.find("norm") != std::string::npos) {
        EXPECT_NE(params[i].grad().data_ptr(), places[i]) << name << ": autograd's own";
      }
    }
    EXPECT_GT(projections, 0U);
    reducer.finish();
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].grad(), sums[i], 1e-5, 1e-6)) << named[i].key();
      EXPECT_EQ(params[i].grad().data_ptr(), places[i]) << named[i].key();
    }
    // Zeroed in place: the next two backwards accumulate into the copy buffer, which reduces
    // where it is.
    accumulate_twice_in_place(reducer, params, loss_of);
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].grad(), sums[i] * 2, 1e-5, 1e-6)) << "parameter " << i;
      EXPECT_EQ(params[i].grad().data_ptr(), places[i]) << "parameter " << i;
    }
  });
}

// ---- pipeline plans --------------------------------------------------------------------------

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

using PipelineMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_replicate<d9d::dynamic>>;
using d9d::precision::Fp64;

// Trains `Plan` on this rank's stages and the same run without a pipeline in one process; losses
// per step and this rank's parameters after the last step must match.
template <class Plan>
void expect_pipeline_matches_one_process(RankEnv& env, const d9d::DistributedContext& ctx,
                                         const std::string& name, int pp, int64_t global_batch,
                                         int64_t microbatch, int layers) {
  const std::string dir = env.scratch_dir() + "/" + name + std::to_string(env.rank());
  const std::string mesh = R"({"pp": )" + std::to_string(pp) + "}";
  d9d::Trainer<Plan> pipelined(
      ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      d9d::testing::tiny_run(dir + "/pp", 4, global_batch, microbatch, false, layers, mesh));
  ASSERT_EQ(pipelined.mesh().size(d9d::MeshDomain::regular, "pp"), pp);
  const auto result = pipelined.train();

  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  d9d::Trainer<OneProcessPlan> single(
      local, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      d9d::testing::tiny_run(dir + "/one", 4, global_batch, global_batch, false, layers));
  const auto reference = single.train();

  ASSERT_EQ(result.losses.size(), reference.losses.size());
  for (std::size_t i = 0; i < result.losses.size(); ++i) {
    EXPECT_NEAR(result.losses[i], reference.losses[i], kLossRtol * std::abs(reference.losses[i]))
        << name << " step " << i;
    EXPECT_NEAR(result.grad_norms[i], reference.grad_norms[i],
                kLossRtol * std::abs(reference.grad_norms[i]))
        << name << " step " << i;
  }
  const auto want = single.core().model()->named_parameters();
  std::size_t compared = 0;
  for (const auto& stage : pipelined.core().modules()) {
    for (const auto& item : stage->named_parameters()) {
      const auto* expected = want.find(item.key());
      ASSERT_NE(expected, nullptr) << name << ": " << item.key();
      EXPECT_TRUE(at::allclose(item.value(), *expected, 0.0, kParameterAtol))
          << name << ": " << item.key() << " max diff " << max_difference(item.value(), *expected);
      ++compared;
    }
  }
  EXPECT_GT(compared, 0U) << name;
  if (pipelined.mesh().size(d9d::MeshDomain::batch, "dp") > 1) {
    // Replicate's all-reduce of the stage starts after its last gradient action, inside the
    // program (ParallelModel::module_done): at least one bucket per step on every rank.
    EXPECT_GT(pipelined.core().parallel().reductions_started_early(), 0U) << name;
  } else {
    EXPECT_EQ(pipelined.core().parallel().reductions_started_early(), 0U) << name;
  }
  ctx.barrier();  // every rank is done with the pipelined trainer's groups before they go
}

TEST(Trainer_Pipeline_Gloo_ws2, EverySchedulePlanMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    using V2 = d9d::pipeline::stages_per_rank<2>;
    // Global batch 8 in microbatches of 2: 4 microbatches through pp = 2.
    expect_pipeline_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::GPipe<>, Fp64>>(
        env, ctx, "gpipe", 2, 8, 2, 4);
    expect_pipeline_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx, "1f1b", 2, 8, 2, 4);
    expect_pipeline_matches_one_process<
        d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleH1<>, Fp64>>(env, ctx, "zbh1", 2, 8, 2, 4);
    expect_pipeline_matches_one_process<
        d9d::Plan<PipelineMesh, d9d::pipeline::Interleaved1F1B<V2>, Fp64>>(env, ctx, "interleaved",
                                                                           2, 8, 2, 4);
    expect_pipeline_matches_one_process<
        d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleV<>, Fp64>>(env, ctx, "zbv", 2, 8, 2, 4);
    expect_pipeline_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::DualPipeV<>, Fp64>>(
        env, ctx, "dualpipev", 2, 8, 2, 4);
    // Static sizes: the program is built and verified by the compiler.
    expect_pipeline_matches_one_process<d9d::Plan<
        d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<d9d::pipeline::microbatches<4>>, Fp64>>(
        env, ctx, "static", 2, 8, 2, 4);
  });
}

// "logging.pipeline_timeline_step": step 2 of a 1F1B run on pp 2 drawn under its plan by world
// rank 0, one rect per compute action per rank in each of the two panels (planned, measured).
TEST(Trainer_Pipeline_Gloo_ws2, TimelinePictureOfAStep) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/timeline" + std::to_string(env.rank());
    using Plan = d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>;
    auto config = d9d::testing::tiny_run(dir, 3, 8, 2, false, 4, R"({"pp": 2})");
    config.logging.pipeline_timeline_step = 2;
    d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, config);
    (void)trainer.train();
    const std::string path = dir + "/pipeline_timeline.svg";
    std::ifstream file(path);
    if (env.rank() == 0) {
      ASSERT_TRUE(file.good()) << path;
      const std::string svg((std::istreambuf_iterator<char>(file)),
                            std::istreambuf_iterator<char>());
      std::size_t rects = 0;
      for (auto at = svg.find(R"(class="action")"); at != std::string::npos;
           at = svg.find(R"(class="action")", at + 1)) {
        ++rects;
      }
      // 4 microbatches of 2 on pp 2: 4 F and 4 B per rank.
      EXPECT_EQ(rects, 2U * 2U * 8U);
      EXPECT_THAT(svg, HasSubstr("measured, step 2"));
    } else {
      EXPECT_FALSE(file.good()) << "only world rank 0 writes " << path;
    }
    // A plan without a pipeline, and a step past the run, are config errors.
    auto flat = d9d::testing::tiny_run(dir + "/flat", 3, 8, 8, false, 4);
    flat.logging.pipeline_timeline_step = 1;
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    EXPECT_THROW(d9d::Trainer<OneProcessPlan>(local, d9d::Qwen3Provider{},
                                              d9d::testing::RandomWindowsProvider{},
                                              d9d::CausalLmTask{}, flat),
                 d9d::ConfigError);
    ctx.barrier();
  });
}

TEST(Trainer_Pipeline_Gloo_ws4, DataParallelTimesPipelineAndPp4MatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // pp 4: 4 microbatches of 2.
    expect_pipeline_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx, "pp4", 4, 8, 2, 4);
    // dp 2 x pp 2: global batch 8, each replica 2 microbatches of 2.
    expect_pipeline_matches_one_process<
        d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleH1<>, Fp64>>(env, ctx, "dp2pp2", 2, 8, 2,
                                                                      4);
  });
}

// ---- training checkpoints across meshes --------------------------------------------------------

// Stops a run after step index `last` (as a crash would), once the checkpoint before it is saved.
template <class T>
void stop_after(T& trainer, int64_t last) {
  trainer.template on<d9d::events::StepEnd>([last](const d9d::events::StepEnd& e) {
    if (e.step == last) {
      throw std::runtime_error("stopped by the test");
    }
  });
}

d9d::TrainerConfig with_checkpoint(d9d::TrainerConfig cfg, const std::string& dir, int64_t every) {
  cfg.checkpoint.dir = dir;
  cfg.checkpoint.every = every;
  cfg.checkpoint.async = false;
  return cfg;
}

TEST(Trainer_Checkpoint_Gloo_ws2, PipelineCheckpointResumesWithoutPipelineAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const std::string dir = env.scratch_dir() + "/rank" + std::to_string(env.rank());
    const std::string shared = env.scratch_dir() + "/checkpoints";
    using PpPlan = d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>;
    const auto run = [&](const std::string& out, const std::string& mesh) {
      return d9d::testing::tiny_run(out, 4, 8, 2, false, 4, mesh);
    };
    // The reference: 4 steps in one process, no pipeline, no checkpoint.
    d9d::Trainer<OneProcessPlan> straight(local, d9d::Qwen3Provider{},
                                          d9d::testing::RandomWindowsProvider{},
                                          d9d::CausalLmTask{}, run(dir + "/straight", ""));
    const auto want = straight.train();
    const auto want_params = straight.core().model()->named_parameters();
    const auto check = [&](const d9d::TrainResult& got,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                           const std::string& name) {
      EXPECT_EQ(got.start_step, 2) << name;
      ASSERT_EQ(got.losses.size(), 2U) << name;
      for (std::size_t i = 0; i < 2; ++i) {
        EXPECT_NEAR(got.losses[i], want.losses[i + 2], kLossRtol * std::abs(want.losses[i + 2]))
            << name << " step " << i + 2;
      }
      for (const auto& module : modules) {
        for (const auto& item : module->named_parameters()) {
          EXPECT_TRUE(at::allclose(item.value(), want_params[item.key()], 0.0, kParameterAtol))
              << name << ": " << item.key();
        }
      }
    };

    // Saved by pp = 2 after 2 steps (each rank its stage), resumed in one process without a
    // pipeline (each rank reads the shared checkpoint on its own).
    {
      d9d::Trainer<PpPlan> first(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          with_checkpoint(run(dir + "/pp", R"({"pp": 2})"), shared + "/pp", 2));
      stop_after(first, 2);
      EXPECT_THROW((void)first.train(), std::runtime_error);
    }
    ctx.barrier();
    d9d::Trainer<OneProcessPlan> whole(local, d9d::Qwen3Provider{},
                                       d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                       with_checkpoint(run(dir + "/whole", ""), shared + "/pp", 0));
    check(whole.train(), whole.core().modules(), "pp2 -> 1");

    // Saved by one process without a pipeline, resumed by pp = 2.
    if (env.rank() == 0) {
      d9d::Trainer<OneProcessPlan> one(local, d9d::Qwen3Provider{},
                                       d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                       with_checkpoint(run(dir + "/one", ""), shared + "/one", 2));
      stop_after(one, 2);
      EXPECT_THROW((void)one.train(), std::runtime_error);
    }
    ctx.barrier();
    d9d::Trainer<PpPlan> staged(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        with_checkpoint(run(dir + "/staged", R"({"pp": 2})"), shared + "/one", 0));
    check(staged.train(), staged.core().modules(), "1 -> pp2");
    ctx.barrier();
  });
}

// ---- asynchronous checkpoints on several ranks -------------------------------------------------

d9d::TrainerConfig async_checkpoints(const RankEnv& env, const std::string& name, int64_t steps) {
  auto cfg = d9d::testing::tiny_run(
      env.scratch_dir() + "/rank" + std::to_string(env.rank()) + "/" + name, steps, 8, 2);
  cfg.checkpoint.dir = env.scratch_dir() + "/" + name;
  cfg.checkpoint.every = 2;
  cfg.checkpoint.keep = 2;
  cfg.checkpoint.async = true;
  return cfg;
}

TEST(Trainer_Checkpoint_Gloo_ws2, AsyncSavesAreWrittenByEveryRankAndResume) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    auto cfg = async_checkpoints(env, "async", 6);
    cfg.checkpoint.keep = 3;
    cfg.run.failure_timeout_s = 30;
    d9d::Trainer<DpPlan> first(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, cfg);
    EXPECT_EQ(ctx.failure_timeout(), std::chrono::seconds(30));  // run.failure_timeout_s applied
    const auto want = first.train();
    // Saves after steps 2, 4 and 6, written in the background: each is completed at a later step
    // boundary or, at the latest, by the next save; the last one by the end of train().
    const std::string dir = cfg.checkpoint.dir;
    EXPECT_EQ(want.checkpoint_dir, dir + "/step-6");
    for (const auto* step : {"step-2", "step-4", "step-6"}) {
      for (const auto* file : {"trainer.json", "rank-0.safetensors", "rank-1.safetensors"}) {
        EXPECT_TRUE(d9d::files::exists(dir + "/" + step + "/" + file)) << step << "/" << file;
      }
    }
    // Replicas: rank 0 (dp coordinate 0) wrote every parameter, as it was after step 6.
    const d9d::state::SafetensorsFile saved(dir + "/step-6/rank-0.safetensors");
    std::size_t compared = 0;
    for (const auto& item : first.core().model()->named_parameters()) {
      ASSERT_TRUE(saved.contains("model/" + item.key())) << item.key();
      EXPECT_TRUE(at::equal(saved.tensor("model/" + item.key()), item.value().detach().cpu()))
          << item.key();
      ++compared;
    }
    EXPECT_GT(compared, 0U);
    ctx.barrier();

    // Resumed from step 4 (same run, same schedule), the last two steps come out as the first
    // run's: same ranks, same order of operations, within the fp64 tolerances of this file.
    auto again = d9d::testing::tiny_run(
        env.scratch_dir() + "/rank" + std::to_string(env.rank()) + "/again", 6, 8, 2);
    again.checkpoint.resume_from = dir + "/step-4";
    again.checkpoint.dir = env.scratch_dir() + "/again";
    d9d::Trainer<DpPlan> resumed(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                 d9d::CausalLmTask{}, again);
    const auto got = resumed.train();
    EXPECT_EQ(got.start_step, 4);
    ASSERT_EQ(got.losses.size(), 2U);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(got.losses[i], want.losses[i + 4], kLossRtol * std::abs(want.losses[i + 4]))
          << "step " << i + 4;
    }
    const auto params = resumed.core().model()->named_parameters();
    for (const auto& item : first.core().model()->named_parameters()) {
      EXPECT_TRUE(at::allclose(params[item.key()], item.value(), 0.0, kParameterAtol))
          << item.key();
    }
  });
}

TEST(Trainer_Checkpoint_Gloo_ws2, AsyncWriterFailureReachesTheTrainingLoopOfEveryRank) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto cfg = async_checkpoints(env, "failing", 6);
    d9d::Trainer<DpPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, cfg);
    // Rank 0's files may not grow beyond 64 KiB past its log's present size (its log may still
    // take a few lines): its checkpoint file (~550 KB of float64 parameters and AdamW state) fails
    // with EFBIG in the background writer, whatever the file system and even as root.
    rlimit saved{};
    ::getrlimit(RLIMIT_FSIZE, &saved);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
    if (env.rank() == 0) {
      struct stat log_file {};
      ::fstat(STDERR_FILENO, &log_file);
      const rlimit small{.rlim_cur = static_cast<rlim_t>(log_file.st_size) + 65536,
                         .rlim_max = saved.rlim_max};
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    std::string error;
    try {
      (void)run.train();
    } catch (const std::exception& e) {
      error = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    // Both ranks stop with rank 0's error, at the step boundary where the writers are done.
    EXPECT_THAT(error, HasSubstr("rank 0 failed")) << error;
    EXPECT_THAT(error, HasSubstr("File too large")) << error;
    ctx.barrier();
    // Nothing became a checkpoint, and the half-written directory is gone.
    EXPECT_FALSE(d9d::files::exists(cfg.checkpoint.dir + "/checkpoints.json"));
    EXPECT_FALSE(d9d::files::exists(cfg.checkpoint.dir + "/step-2"));
    EXPECT_FALSE(d9d::files::exists(cfg.checkpoint.dir + "/step-2.tmp"));
  });
}

// A fault on rank 1 alone: both ranks stop at the same step with the same error, and with
// "numerics.on_nonfinite": "skip" both skip it and stay replicas of each other.
TEST(Trainer_Numerics_Gloo_ws2, EveryRankStopsOrSkipsTheSameStep) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto dir = env.scratch_dir() + "/numerics/rank" + std::to_string(env.rank());
    const d9d::testing::FaultyTask nan_on_rank1{.first = 2,
                                                .last = 2,
                                                .factor = std::numeric_limits<double>::quiet_NaN(),
                                                .active = env.rank() == 1};
    {
      d9d::Trainer<DpPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               nan_on_rank1, d9d::testing::tiny_run(dir + "/stop", 5, 8, 2));
      nan_on_rank1.follow(run);
      std::string error;
      try {
        (void)run.train();
      } catch (const d9d::NumericalError& e) {
        error = e.what();
      }
      EXPECT_THAT(error, HasSubstr("step 3 of 5 (index 2): loss nan")) << error;
    }
    ctx.barrier();

    // Skipping: infinite gradients on rank 1 only (the loss stays finite everywhere).
    auto cfg = d9d::testing::tiny_run(dir + "/skip", 5, 8, 2);
    cfg.numerics.on_nonfinite = "skip";
    const d9d::testing::FaultyTask inf_on_rank1{.first = 2,
                                                .last = 2,
                                                .factor = std::numeric_limits<double>::infinity(),
                                                .gradient_only = true,
                                                .active = env.rank() == 1};
    d9d::Trainer<DpPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             inf_on_rank1, cfg);
    inf_on_rank1.follow(run);
    int optimizer_steps = 0;
    run.on<d9d::events::AfterOptimizer>([&](const auto&) { ++optimizer_steps; });
    const auto result = run.train();
    EXPECT_EQ(result.skipped_steps, (std::vector<int64_t>{2}));
    EXPECT_EQ(optimizer_steps, 4);
    // The replicas are bit-identical: max and min over the ranks of every parameter agree.
    const auto& world = ctx.world();
    for (const auto& item : run.core().model()->named_parameters()) {
      const auto mine = item.value().detach().flatten();
      EXPECT_TRUE(at::isfinite(mine).all().item<bool>()) << item.key();
      const auto high = d9d::all_reduce(world, mine, d9d::ReduceOp::max);
      const auto low = d9d::all_reduce(world, mine, d9d::ReduceOp::min);
      EXPECT_TRUE(at::equal(high, low)) << item.key();
    }
  });
}

}  // namespace
