// Mixed precision under every strategy, on 2 and 4 Gloo ranks (or NCCL with D9D_TEST_BACKEND=nccl),
// against one process training the same global batch in float32: Bf16Mixed (float32 master
// parameters, bfloat16 compute) under Replicate, FullyShard in each reshard mode and with the
// bfloat16 reduction, HSDP 2 x 2, tp 2 with and without sequence parallelism, tp 2 x FullyShard 2,
// pp 2 (1F1B, ZeroBubbleH1) and ep 2 (the tiny MoE), and bfloat16 parameters with stochastic
// rounding (Bf16Params) under FullyShard. The bounds are in units of bfloat16's unit roundoff
// (below); a run that skips the gradient reduction (one process on half the batch) must break
// them, so they are tight enough to see a wrong reduction.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::precision::Bf16Mixed;
using d9d::precision::Bf16MixedBf16Reduce;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using Parameters = std::map<std::string, at::Tensor>;

constexpr int64_t kSteps = 6;

// tiny_run without clipping: the gradients the optimizer sees are the reduced ones.
d9d::TrainerConfig run_config(const std::string& dir, int64_t global_batch, int64_t microbatch,
                              const std::string& mesh = "", bool moe = false) {
  auto config = d9d::testing::tiny_run(dir, kSteps, global_batch, microbatch, false, 4, mesh);
  config.gradient_clipping.max_norm = std::nullopt;
  if (moe) {
    config.sections["model"] = d9d::testing::tiny_qwen3_moe_json(/*aux=*/true);
  }
  return config;
}

// A run's outcome with its first step's gradients (whole tensors; a pipeline rank's stages).
struct Trained {
  RunOutcome outcome;
  Parameters gradient;
};

template <class Plan, class Provider = d9d::Qwen3Provider>
Trained train(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config,
              Parameters* initial = nullptr) {
  d9d::Trainer<Plan> trainer(ctx, Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
  if (initial != nullptr) {
    // A copy: on the CPU full_parameters() may return the trained tensors themselves.
    for (const auto& [name, value] : d9d::testing::full_parameters(trainer.core())) {
      (*initial)[name] = value.clone();
    }
  }
  Trained out;
  trainer.template on<d9d::events::BeforeOptimizer>([&](const d9d::events::BeforeOptimizer& e) {
    if (e.step != 0) {
      return;
    }
    for (auto record : trainer.core().parallel().parameters()) {  // a copy: local := its gradient
      if (record.tied_copy) {
        continue;
      }
      record.local = record.local.grad();
      out.gradient[record.name] =
          record.sharded(trainer.core().mesh()).full_tensor().cpu().to(at::kDouble);
    }
  });
  out.outcome = d9d::testing::outcome_of(trainer);
  return out;
}

// How far a run is from another. The first step starts from the same parameters, so its loss and
// gradients differ only by rounding: `loss0` = |Δloss| / loss, `gradient0` = ‖Δg‖ / ‖g‖ over every
// parameter `got` has. Later steps follow AdamW, whose normalised update m / sqrt(v) turns any
// difference of a small gradient entry into a whole step, so the trajectories drift apart: `loss`
// is the largest relative difference of a step's loss, `update` = ‖Δgot − Δwant‖ / ‖Δwant‖ with
// Δ = final − initial parameters.
struct Deviation {
  double loss0 = 0.0;
  double gradient0 = 0.0;
  double loss = 0.0;
  double update = 0.0;
};

std::ostream& operator<<(std::ostream& os, const Deviation& d) {
  return os << "loss0 " << d.loss0 << ", gradient0 " << d.gradient0 << ", loss " << d.loss
            << ", update " << d.update;
}

// sqrt(Σ‖a − b‖²) / sqrt(Σ‖b‖²) over the names in `a`.
double relative(const Parameters& a, const Parameters& b, const Parameters* base = nullptr) {
  double diff = 0.0;
  double size = 0.0;
  for (const auto& [name, value] : a) {
    auto x = value.to(at::kDouble);
    auto y = b.at(name).to(at::kDouble);
    if (base != nullptr) {
      x = x - base->at(name).to(at::kDouble);
      y = y - base->at(name).to(at::kDouble);
    }
    diff += (x - y).pow(2).sum().item<double>();
    size += y.pow(2).sum().item<double>();
  }
  return std::sqrt(diff / size);
}

Deviation deviation(const Trained& got, const Trained& want, const Parameters& initial) {
  const auto& g = got.outcome.result;
  const auto& w = want.outcome.result;
  Deviation out;
  EXPECT_EQ(g.losses.size(), w.losses.size());
  for (std::size_t i = 0; i < std::min(g.losses.size(), w.losses.size()); ++i) {
    out.loss = std::max(out.loss, std::abs(g.losses[i] - w.losses[i]) / std::abs(w.losses[i]));
  }
  out.loss0 = std::abs(g.losses[0] - w.losses[0]) / std::abs(w.losses[0]);
  out.gradient0 = relative(got.gradient, want.gradient);
  out.update = relative(got.outcome.parameters, want.outcome.parameters, &initial);
  return out;
}

// The references of one case, each trained in one process on the whole global batch of 8.
struct References {
  Parameters initial;  // the same in every run (seeded), float32
  Trained fp32;
  Trained bf16;
};

template <class Provider = d9d::Qwen3Provider>
References references(RankEnv& env, const d9d::DistributedContext& ctx, int64_t microbatch,
                      bool moe = false) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  const std::string dir = env.scratch_dir() + "/one" + std::to_string(env.rank());
  References out;
  out.fp32 = train<d9d::Plan<>, Provider>(local, run_config(dir + "/fp32", 8, microbatch, "", moe),
                                          &out.initial);
  out.bf16 = train<d9d::Plan<Bf16Mixed>, Provider>(
      local, run_config(dir + "/bf16", 8, microbatch, "", moe));
  return out;
}

// The bounds. bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8. Under bfloat16 compute
// each matrix product rounds its inputs and its output (float32 accumulation inside), so a value
// carries a relative error of about u per rounding on its path, of either sign.
constexpr double kU = 1.0 / 256;
// The first gradient: a weight's gradient sum_t dy_t x_t^T has x rounded (u), dy arriving through
// the backward of 4 blocks and the head (about 3 roundings each: ~15 in all) and the sum rounded
// (u). Independent roundings of uniform error in [-u, u] add in quadrature, u·sqrt(k / 3) ≈ 2.3u
// for k = 16; FullyShard and Bf16Params round the parameters too (a few more). Bound: 4u (1.6%).
// Measured: one process 1.8u, every strategy <= 2.7u; without the reduction 252u.
constexpr double kGradient0 = 4 * kU;
// The first loss: a mean over 8 x 16 tokens of per-token losses whose errors have either sign
// (the mean's error shrinks by sqrt(128)). Bound u/32 = 1.2e-4. Measured <= 1.6e-5; without the
// reduction 3.6e-3 (the other half of the batch is missing from the mean).
constexpr double kLoss0 = kU / 32;
// Six AdamW steps: the normalised update m / sqrt(v) gives a gradient entry that rounding moves
// across zero a whole step of the other sign, so the runs drift apart by more than rounding; these
// bound the drift, not the rounding. Losses u/2 (measured <= 5.4e-4, without the reduction 1e-2);
// the parameters' update over the run 1/4 relative (measured <= 0.13, without the reduction 0.83).
constexpr double kLoss = kU / 2;
constexpr double kUpdate = 0.25;

// `got` follows the float32 run of one process as bfloat16 allows.
void expect_tracks_float32(const Trained& got, const References& ref, const std::string& what) {
  const auto d = deviation(got, ref.fp32, ref.initial);
  EXPECT_LE(d.loss0, kLoss0) << what << ": " << d;
  EXPECT_LE(d.gradient0, kGradient0) << what << ": " << d;
  EXPECT_LE(d.loss, kLoss) << what << ": " << d;
  EXPECT_LE(d.update, kUpdate) << what << ": " << d;
}

using ReplicateMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
using Bf16Reduce = d9d::parallel::FullyShard<d9d::parallel::Reshard::from_config,
                                             d9d::parallel::ReduceDtype::bfloat16>;

TEST(MixedPrecision_ws2, DataParallelTracksFloat32) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto ref = references(env, ctx, 2);
    expect_tracks_float32(ref.bf16, ref, "Bf16Mixed in one process");
    if (env.rank() == 0) {
      // What a rank alone trains (its half of the batch, no reduction) breaks every bound.
      const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
      const auto alone = deviation(
          train<d9d::Plan<Bf16Mixed>>(local, run_config(env.scratch_dir() + "/half", 4, 2)),
          ref.fp32, ref.initial);
      EXPECT_GT(alone.loss0, 10 * kLoss0) << alone;
      EXPECT_GT(alone.gradient0, 10 * kGradient0) << alone;
      EXPECT_GT(alone.loss, 2 * kLoss) << alone;
      EXPECT_GT(alone.update, 2 * kUpdate) << alone;
    }
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto replicate =
        train<d9d::Plan<ReplicateMesh, Bf16Mixed>>(ctx, run_config(dir + "/replicate", 8, 2));
    expect_tracks_float32(replicate, ref, "Replicate");
    // The precision's bfloat16 `reduce`: Replicate's all-reduce rounds each rank's gradient and
    // the sum once more (<= u each).
    const auto replicate_bf16 = train<d9d::Plan<ReplicateMesh, Bf16MixedBf16Reduce>>(
        ctx, run_config(dir + "/replicate_bf16", 8, 2));
    expect_tracks_float32(replicate_bf16, ref, "Replicate, bfloat16 reduction");
    const double by_all_reduce = relative(replicate_bf16.gradient, replicate.gradient);
    EXPECT_GT(by_all_reduce, 0.0) << "the bfloat16 all-reduce left the gradients as they were";
    EXPECT_LE(by_all_reduce, 2 * kU);
    const auto fsdp = [&](const std::string& mode) {
      auto config = run_config(dir + "/" + mode, 8, 2);
      config.data_parallel.reshard = mode;
      return train<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Bf16Mixed>>(ctx, config);
    };
    const auto float32_reduce = fsdp("after_forward");
    expect_tracks_float32(float32_reduce, ref, "FullyShard, reshard after_forward");
    for (const std::string mode : {"never", "all_but_last"}) {
      expect_tracks_float32(fsdp(mode), ref, "FullyShard, reshard " + mode);
    }
    // The bfloat16 reduction rounds each rank's gradient and the sum once more (<= u each).
    const auto bf16_reduce = train<d9d::Plan<ShardMesh, Bf16Reduce, Bf16Mixed>>(
        ctx, run_config(dir + "/bf16_reduce", 8, 2));
    expect_tracks_float32(bf16_reduce, ref, "FullyShard, bfloat16 reduction");
    const double by_reduction = relative(bf16_reduce.gradient, float32_reduce.gradient);
    EXPECT_GT(by_reduction, 0.0) << "the bfloat16 reduction left the gradients as they were";
    EXPECT_LE(by_reduction, 2 * kU);
    // FullyShard<R, ReduceDtype::as_precision> reads the same fact: the same run, bit for bit.
    const auto as_precision =
        train<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Bf16MixedBf16Reduce>>(
            ctx, run_config(dir + "/bf16_reduce_as_precision", 8, 2));
    EXPECT_EQ(relative(as_precision.gradient, bf16_reduce.gradient), 0.0);
    EXPECT_EQ(as_precision.outcome.result.losses, bf16_reduce.outcome.result.losses);
    // The fastest setting on GPUs (docs/parallel.md): units kept gathered, one reduce-scatter per
    // step. A rank's microbatch gradients then add up in its gathered bfloat16 parameters'
    // gradients before the reduction (one more rounding per microbatch after the first, <= u).
    auto once = run_config(dir + "/once", 8, 2);
    once.data_parallel.reshard = "never";
    once.data_parallel.reduce_every_microbatch = false;
    expect_tracks_float32(
        train<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Bf16Mixed>>(ctx, once), ref,
        "FullyShard, reshard never, one reduction per step");
    once.run.output_dir = dir + "/once_bf16";
    expect_tracks_float32(train<d9d::Plan<ShardMesh, Bf16Reduce, Bf16Mixed>>(ctx, once), ref,
                          "FullyShard, reshard never, one bfloat16 reduction per step");
    expect_tracks_float32(
        train<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, d9d::precision::Bf16Params<>>>(
            ctx, run_config(dir + "/sr", 8, 2)),
        ref, "FullyShard, Bf16Params (stochastic rounding)");
  });
}

TEST(MixedPrecision_ws2, TensorParallelAndPipelinesTrackFloat32) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto ref = references(env, ctx, 2);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;
    using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
    expect_tracks_float32(train<d9d::Plan<TpMesh, d9d::parallel::TensorParallel<>, Bf16Mixed>>(
                              ctx, run_config(dir + "/tp", 8, 2)),
                          ref, "tp 2");
    expect_tracks_float32(
        train<d9d::Plan<TpMesh, TpSp, Bf16Mixed>>(ctx, run_config(dir + "/tp_sp", 8, 2)), ref,
        "tp 2, sequence parallel");
    // A pipeline runs the same microbatches through the same layers as one process: on the CPU
    // its first step is the one process's Bf16Mixed step to float32 rounding. On a GPU the whole
    // model computes its head and loss in one fused, chunked function (linear_cross_entropy) and
    // the last stage does not, so the two differ by about one bfloat16 rounding (measured 0.35u
    // on an H200).
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    const double same_kernels = ctx.device().is_cuda() ? kU : 1e-6;
    const auto check_pipeline = [&](const Trained& got, const std::string& what) {
      expect_tracks_float32(got, ref, what);
      const auto d = deviation(got, ref.bf16, ref.initial);
      EXPECT_LE(d.loss0, same_kernels) << what << " vs one process in Bf16Mixed: " << d;
      EXPECT_LE(d.gradient0, same_kernels) << what << " vs one process in Bf16Mixed: " << d;
    };
    check_pipeline(train<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, Bf16Mixed>>(
                       ctx, run_config(dir + "/1f1b", 8, 2, R"({"pp": 2})")),
                   "pp 2, 1F1B");
    check_pipeline(train<d9d::Plan<PpMesh, d9d::pipeline::ZeroBubbleH1<>, Bf16Mixed>>(
                       ctx, run_config(dir + "/zb", 8, 2, R"({"pp": 2})")),
                   "pp 2, ZeroBubbleH1");
  });
}

TEST(MixedPrecision_ws2, ExpertParallelTracksFloat32) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // The auxiliary loss uses global-batch statistics: the reference's microbatch of 4 is the
    // union of the ranks' microbatches of 2 (tests/parallel/moe_multiprocess_test.cpp).
    const auto ref = references<d9d::Qwen3MoeProvider>(env, ctx, 4, /*moe=*/true);
    expect_tracks_float32(ref.bf16, ref, "the MoE in Bf16Mixed in one process");
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using EpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    expect_tracks_float32(
        train<d9d::Plan<EpMesh, d9d::parallel::ExpertParallel<>, Bf16Mixed>, d9d::Qwen3MoeProvider>(
            ctx, run_config(dir + "/ep", 8, 2, R"({"ep": 2})", true)),
        ref, "ep 2");
  });
}

TEST(MixedPrecision_ws4, HsdpAndTensorParallelTimesFullyShardTrackFloat32) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto ref = references(env, ctx, 2);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using HsdpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>;
    expect_tracks_float32(
        train<d9d::Plan<HsdpMesh, d9d::parallel::Fsdp, Bf16Mixed>>(
            ctx, run_config(dir + "/hsdp", 8, 2, R"({"dp_replicate": 2, "dp_shard": 2})")),
        ref, "HSDP 2 x 2");
    using TpShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
    expect_tracks_float32(
        train<d9d::Plan<TpShardMesh, d9d::parallel::TensorParallel<>, d9d::parallel::Fsdp,
                        Bf16Mixed>>(
            ctx, run_config(dir + "/tp_fsdp", 8, 2, R"({"dp_shard": 2, "tp": 2})")),
        ref, "tp 2 x FullyShard 2");
  });
}

}  // namespace
