// The parallelize layer's data-parallel strategies on 2 and 4 ranks (Gloo, or NCCL with
// D9D_TEST_BACKEND=nccl) against one process training the same global batch: FullyShard on 2 and 4
// ranks in each reshard mode, HSDP 2 x 2, FullyShard 2 x pp 2, with gradient accumulation,
// clipping and recompute; the memory each rank holds under FullyShard; training checkpoints saved
// on one mesh and resumed on another (tensor-parallel layouts among them), and resumed runs
// continuing from a tensor-parallel checkpoint on another layout (tp 2 -> one process, tp 2 x
// FullyShard 2 -> FullyShard 4); context-parallel checkpoints (FullyShard x cp 2, cp 2) to one
// process and back.
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;

using d9d::precision::Fp64;
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
using OneProcess = d9d::Plan<Fp64>;

// 6 steps, global batch 8 in microbatches of 2 (several microbatches per rank: accumulation),
// clipping at 0.5 (tiny_run), 4 decoder layers.
d9d::TrainerConfig run_config(const std::string& dir, const std::string& mesh = "") {
  return tiny_run(dir, 6, 8, 2, false, 4, mesh);
}

RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_plan<OneProcess>(
      local, tiny_run(env.scratch_dir() + "/one" + std::to_string(env.rank()), 6, 8, 8, false, 4));
}

class Parallel_FullyShard : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(GetParam()); }
};

TEST_P(Parallel_FullyShard, EveryReshardModeMatchesOneProcess) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = reference(env, ctx);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    // The policy's default reshard comes from the config; the static choices fix it.
    for (const std::string mode : {"after_forward", "never", "all_but_last"}) {
      auto config = run_config(dir + "/" + mode);
      config.data_parallel.reshard = mode;
      d9d::testing::expect_same_run(
          train_plan<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Fp64>>(ctx, config), want,
          "reshard " + mode);
    }
    using Never = d9d::parallel::FullyShard<d9d::parallel::Reshard::never>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, Never, Fp64>>(ctx, run_config(dir + "/static")), want,
        "static never");
    // No prefetch; one reduce-scatter per step (whole gradients kept over the microbatches).
    auto once = run_config(dir + "/once");
    once.data_parallel.prefetch = 0;
    once.data_parallel.reduce_every_microbatch = false;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Fp64>>(ctx, once), want,
        "prefetch 0, one reduction per step");
  });
}

TEST_P(Parallel_FullyShard, WithRecomputeMatchesOneProcess) {
  d9d::testing::run_on_ranks({.world_size = GetParam()}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = reference(env, ctx);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, d9d::recompute::Full, Fp64>>(
            ctx, run_config(dir + "/full")),
        want, "recompute every block");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, d9d::recompute::EveryNth<2>, Fp64>>(
            ctx, run_config(dir + "/every2")),
        want, "recompute every 2nd block");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, d9d::recompute::Attention<>, Fp64>>(
            ctx, run_config(dir + "/attention")),
        want, "recompute every block's attention");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Parallel_FullyShard, ::testing::Values(2, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

// Three ranks split rows unevenly (torch.chunk's rule): the 64 vocabulary rows as 22, 22, 20 and
// the 32-wide norms as 11, 11, 10, so the last rank's gradient slices are shorter than the others'.
TEST(Parallel_FullyShard_ws3, UnevenShardsMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(3);
  d9d::testing::run_on_ranks({.world_size = 3}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = train_plan<OneProcess>(local, tiny_run(dir + "/one", 6, 12, 12, false, 4));
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Fp64>>(
            ctx, tiny_run(dir + "/fsdp", 6, 12, 2, false, 4)),
        want, "FullyShard over 3 ranks");
  });
}

TEST(Parallel_FullyShard_ws4, HsdpAndPipelineMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto want = reference(env, ctx);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    // HSDP: shards over dp_shard = 2, replicated over dp_replicate = 2.
    using HsdpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<HsdpMesh, d9d::parallel::Fsdp, Fp64>>(
            ctx, run_config(dir + "/hsdp", R"({"dp_replicate": 2, "dp_shard": 2})")),
        want, "HSDP 2x2");
    // FullyShard 2 x pipeline 2 (each rank compares its stages' parameters).
    // The reduce-scatters of each stage's blocks start after the stage's last gradient action,
    // inside the program (ParallelModel::module_done), on every rank and step.
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>;
    const auto one_f_one_b =
        train_plan<d9d::Plan<PpMesh, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(
            ctx, run_config(dir + "/pp", R"({"pp": 2, "dp_shard": 2})"));
    d9d::testing::expect_same_run(one_f_one_b, want, "FSDP 2 x pp 2");
    EXPECT_GT(one_f_one_b.reductions_started_early, 0U);
    const auto zero_bubble =
        train_plan<d9d::Plan<PpMesh, d9d::parallel::Fsdp, d9d::pipeline::ZeroBubbleH1<>, Fp64>>(
            ctx, run_config(dir + "/zb", R"({"pp": 2, "dp_shard": 2})"));
    d9d::testing::expect_same_run(zero_bubble, want,
                                  "FSDP 2 x pp 2, ZeroBubbleH1 (weight gradients in W actions)");
    EXPECT_GT(zero_bubble.reductions_started_early, 0U);
    // The reshard setting under a pipeline: after_forward gathers each block for its forward and
    // its backward and frees it after them (here without prefetch: one block of the stage at a
    // time), never keeps the stage's blocks for the step, all_but_last keeps the rank's last
    // block (its stage's second) and frees the other; all three train as one process does.
    auto after_forward = run_config(dir + "/pp-after", R"({"pp": 2, "dp_shard": 2})");
    after_forward.data_parallel.prefetch = 0;
    auto never = run_config(dir + "/pp-never", R"({"pp": 2, "dp_shard": 2})");
    never.data_parallel.reshard = "never";
    const auto freed =
        train_plan<d9d::Plan<PpMesh, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(
            ctx, after_forward);
    const auto kept =
        train_plan<d9d::Plan<PpMesh, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(ctx,
                                                                                            never);
    auto all_but_last = run_config(dir + "/pp-last", R"({"pp": 2, "dp_shard": 2})");
    all_but_last.data_parallel.prefetch = 0;
    all_but_last.data_parallel.reshard = "all_but_last";
    const auto last_kept =
        train_plan<d9d::Plan<PpMesh, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(
            ctx, all_but_last);
    d9d::testing::expect_same_run(freed, want, "FSDP 2 x pp 2, after_forward, no prefetch");
    d9d::testing::expect_same_run(kept, want, "FSDP 2 x pp 2, never");
    d9d::testing::expect_same_run(last_kept, want, "FSDP 2 x pp 2, all_but_last, no prefetch");
    // Each stage: the loose parameters and 2 blocks; one block's worth less at the peak when
    // every block is freed; the block all_but_last keeps is held beside the one in use.
    EXPECT_GT(freed.peak_extra_bytes, 0);
    EXPECT_LT(freed.peak_extra_bytes, kept.peak_extra_bytes);
    EXPECT_LT(freed.peak_extra_bytes, last_kept.peak_extra_bytes);
    EXPECT_LE(last_kept.peak_extra_bytes, kept.peak_extra_bytes);
  });
}

// The export gathers each sharded parameter in turn and the main rank streams it to the file: the
// checkpoint holds the whole model, equal to the gathered shards, and loads as a Qwen3.
TEST(Parallel_FullyShard_ws2, ExportsTheWholeModel) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    auto config = tiny_run(env.scratch_dir() + "/run", 2, 8, 2, /*outputs=*/true, 3);
    config.logging.progress = false;
    d9d::Trainer<d9d::Plan<ShardMesh, d9d::parallel::Fsdp>> trainer(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        config);
    const auto result = trainer.train();
    const auto parameters = d9d::testing::full_parameters(trainer.core());
    if (env.rank() != 0) {
      return;
    }
    ASSERT_EQ(result.export_dir, env.scratch_dir() + "/run/model");
    d9d::testing::expect_exported_equals(*d9d::model::load_hf_qwen3(result.export_dir), parameters);
  });
}

// What a rank holds between steps: parameters, their gradients and AdamW's state are a quarter of
// one process's (plus the padding of uneven shards), and nothing stays gathered.
TEST(Parallel_FullyShard_ws4, EachRankHoldsAQuarterOfTheState) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto bytes = [](d9d::detail::TrainerCore& core) {
      return core.parallel().parameter_bytes() + core.parallel().gradient_bytes() +
             d9d::testing::optimizer_state_bytes(core.optimizer());
    };
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    d9d::Trainer<OneProcess> single(local, d9d::Qwen3Provider{},
                                    d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                    tiny_run(dir + "/one", 2, 8, 8, false, 4));
    (void)single.train();
    const int64_t whole = bytes(single.core());

    d9d::Trainer<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, Fp64>> sharded(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        tiny_run(dir + "/fsdp", 2, 8, 2, false, 4));
    int64_t gathered_at_optimizer = -1;
    sharded.on<d9d::events::BeforeOptimizer>([&](const d9d::events::BeforeOptimizer&) {
      gathered_at_optimizer =
          std::max(gathered_at_optimizer, sharded.core().parallel().extra_bytes());
    });
    (void)sharded.train();
    const int64_t mine = bytes(sharded.core());
    // The largest unit, gathered: a decoder layer of the tiny Qwen3 (q, k, v, o; gate, up, down;
    // two layer norms and the per-head q/k norms), float64.
    const int64_t one_unit =
        int64_t{32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 + 2 * 8} * 8;
    EXPECT_LE(mine, whole / 4 + one_unit) << "one process holds " << whole;
    EXPECT_GT(mine, 0);
    EXPECT_EQ(sharded.core().parallel().extra_bytes(), 0) << "units left gathered after the step";
    EXPECT_EQ(gathered_at_optimizer, 0) << "units still gathered when the optimizer steps";
  });
}

// ---- training checkpoints across meshes ------------------------------------------------------

d9d::TrainerConfig checkpointed(d9d::TrainerConfig cfg, const std::string& dir) {
  cfg.checkpoint.dir = dir;
  cfg.checkpoint.every = 2;
  cfg.checkpoint.keep = 4;
  cfg.checkpoint.async = false;
  return cfg;
}

// Saved on mesh B after 2 of 4 steps, loaded on mesh A (all ranks, or one process on rank 0) and
// saved there again, loaded on B and run to the end: the losses of steps 2 and 3 and the final
// parameters are bit-identical to B's uninterrupted run (fp32: nothing is rounded on the way, every
// piece is copied as stored). One launch, one context per process.
template <class PlanB, class PlanA>
void expect_lossless_reshard(RankEnv& env, const std::string& mesh_b, const std::string& mesh_a,
                             bool a_is_one_process) {
  const auto ctx = d9d::testing::rank_context(env);
  const std::string& root = env.scratch_dir();
  const auto r = std::to_string(env.rank());
  const auto config = [&](const std::string& out, const std::string& mesh) {
    return tiny_run(root + "/" + out + r, 4, 8, 2, false, 4, mesh);
  };
  d9d::Trainer<PlanB> straight(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, checkpointed(config("b", mesh_b), root + "/B"));
  const auto want = straight.train();
  const auto want_parameters = d9d::testing::full_parameters(straight.core());

  if (!a_is_one_process || env.rank() == 0) {
    const auto a_ctx =
        a_is_one_process ? d9d::DistributedContext::local({.device = ctx.device().str()}) : ctx;
    auto cfg = checkpointed(config("a", mesh_a), root + "/A");
    cfg.checkpoint.resume_from = root + "/B/step-2";
    d9d::Trainer<PlanA> other(a_ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              d9d::CausalLmTask{}, cfg);
    EXPECT_EQ(other.core().save_checkpoint(), root + "/A/step-2");
  }
  ctx.barrier();

  auto cfg = checkpointed(config("c", mesh_b), root + "/C");
  cfg.checkpoint.resume_from = root + "/A/step-2";
  d9d::Trainer<PlanB> resumed(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              d9d::CausalLmTask{}, cfg);
  const auto got = resumed.train();
  EXPECT_EQ(got.resumed_from, root + "/A/step-2");
  d9d::testing::expect_resumed_run(got, d9d::testing::full_parameters(resumed.core()), want,
                                   want_parameters, 2);
  ctx.barrier();
}

using FsdpPlan = d9d::Plan<ShardMesh, d9d::parallel::Fsdp>;
using HsdpPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>,
                           d9d::parallel::Fsdp>;
using FsdpPpPlan = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>,
                             d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>>;
constexpr const char* kHsdp22 = R"({"dp_replicate": 2, "dp_shard": 2})";
using TpPlan = d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>, d9d::parallel::TensorParallel<>>;
using TpFsdpPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>,
                             d9d::parallel::TensorParallel<>, d9d::parallel::Fsdp>;

TEST(Parallel_Checkpoint_ws2, FsdpTwoToOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    expect_lossless_reshard<FsdpPlan, d9d::Plan<>>(env, "", "", true);
  });
}

TEST(Parallel_Checkpoint_ws4, FsdpFourToHsdpTwoByTwoAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_lossless_reshard<FsdpPlan, HsdpPlan>(env, "", kHsdp22, false);
  });
}

TEST(Parallel_Checkpoint_ws4, HsdpTwoByTwoToFsdpFourAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_lossless_reshard<HsdpPlan, FsdpPlan>(env, kHsdp22, "", false);
  });
}

TEST(Parallel_Checkpoint_ws4, FsdpTwoByPipelineTwoToFsdpFourAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_lossless_reshard<FsdpPpPlan, FsdpPlan>(env, R"({"pp": 2, "dp_shard": 2})", "", false);
  });
}

// Tensor-parallel shards (Shard on tp, and on tp then dp_shard) saved and assembled elsewhere.
TEST(Parallel_Checkpoint_ws2, TensorParallelTwoToOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    expect_lossless_reshard<TpPlan, d9d::Plan<>>(env, R"({"tp": 2})", "", true);
  });
}

// Context parallelism: checkpoints do not depend on cp. FullyShard x cp 2 (the parameters sharded
// over the cp ranks, dense domain's dp_cp_shard) and cp 2 under Replicate (replicated over cp) to
// one process and back.
using CpFsdpPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>,
                             d9d::parallel::ContextParallel<>, d9d::parallel::Fsdp>;
using CpPlan = d9d::Plan<d9d::mesh<d9d::cp_shard<d9d::dynamic>>,
                         d9d::parallel::ContextParallel<d9d::parallel::KvRotation::ring>>;

TEST(Parallel_Checkpoint_ws2, FsdpTimesCpTwoToOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    expect_lossless_reshard<CpFsdpPlan, d9d::Plan<>>(env, R"({"dp_shard": 1, "cp_shard": 2})", "",
                                                     true);
  });
}

TEST(Parallel_Checkpoint_ws2, CpTwoToOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    expect_lossless_reshard<CpPlan, d9d::Plan<>>(env, R"({"cp_shard": 2})", "", true);
  });
}

TEST(Parallel_Checkpoint_ws4, TensorParallelTwoByFsdpTwoToFsdpFourAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_lossless_reshard<TpFsdpPlan, FsdpPlan>(env, R"({"dp_shard": 2, "tp": 2})", "", false);
  });
}

// ---- resuming on another tensor-parallel layout and training on -------------------------------

// Mesh B trains 4 steps in float64, saving after step 2; mesh A (all ranks, or one process on rank
// 0) resumes from B's step 2 and trains steps 2 and 3. "Continues exactly" is checked two ways:
//  - bit for bit: A's run equals A resumed from a checkpoint in A's own layout holding the same
//    state (B's step 2 loaded on A and saved there), so nothing of B's layout is left over;
//  - within the float64 tolerances of the tp-against-one-process tests (train_test_util.hpp):
//    A's steps 2 and 3 follow B's uninterrupted ones (same state, the sums split otherwise).
// `got` (steps 2 and 3 after a resume) equals `same_state` bit for bit and follows `want`'s
// uninterrupted steps 2 and 3 within the float64 tolerances.
void expect_continues(const RunOutcome& got, const RunOutcome& same_state, const RunOutcome& want) {
  ASSERT_EQ(got.result.losses.size(), 2U);
  ASSERT_EQ(same_state.result.losses.size(), 2U);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.result.losses[i], same_state.result.losses[i]) << "step " << i + 2;
    EXPECT_EQ(got.result.grad_norms[i], same_state.result.grad_norms[i]) << "step " << i + 2;
    EXPECT_NEAR(got.result.losses[i], want.result.losses[i + 2],
                d9d::testing::kLossRtol * std::abs(want.result.losses[i + 2]))
        << "step " << i + 2;
    EXPECT_NEAR(got.result.grad_norms[i], want.result.grad_norms[i + 2],
                d9d::testing::kLossRtol * std::abs(want.result.grad_norms[i + 2]))
        << "step " << i + 2;
  }
  ASSERT_EQ(got.parameters.size(), want.parameters.size());
  for (const auto& [name, value] : got.parameters) {
    const at::Tensor& uninterrupted = want.parameters.at(name);
    EXPECT_TRUE(at::equal(value, same_state.parameters.at(name))) << name;
    EXPECT_TRUE(at::allclose(value, uninterrupted, 0.0, d9d::testing::kParameterAtol))
        << name << " max diff " << (value - uninterrupted).abs().max().item<double>();
  }
}

template <class PlanB, class PlanA>
void expect_resume_continues(RankEnv& env, const std::string& mesh_b, const std::string& mesh_a,
                             bool a_is_one_process) {
  const auto ctx = d9d::testing::rank_context(env);
  const std::string& root = env.scratch_dir();
  const auto r = std::to_string(env.rank());
  const auto config = [&](const std::string& out, const std::string& mesh,
                          const std::string& checkpoints) {
    return checkpointed(tiny_run(root + "/" + out + r, 4, 8, 2, false, 4, mesh),
                        root + "/" + checkpoints);
  };
  d9d::Trainer<PlanB> straight(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, config("b", mesh_b, "B"));
  const RunOutcome want = d9d::testing::outcome_of(straight);
  ctx.barrier();
  if (a_is_one_process && env.rank() != 0) {
    ctx.barrier();
    return;
  }
  const auto a_ctx =
      a_is_one_process ? d9d::DistributedContext::local({.device = ctx.device().str()}) : ctx;
  const auto resume_on_a = [&](const std::string& from, const std::string& name) {
    auto cfg = config(name, mesh_a, name);
    cfg.checkpoint.resume_from = from;
    cfg.checkpoint.every = 0;
    d9d::Trainer<PlanA> trainer(a_ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{}, cfg);
    return d9d::testing::outcome_of(trainer);
  };
  const RunOutcome got = resume_on_a(root + "/B/step-2", "A1");
  EXPECT_EQ(got.result.start_step, 2);
  {
    auto cfg = config("a0", mesh_a, "A0");
    cfg.checkpoint.resume_from = root + "/B/step-2";
    d9d::Trainer<PlanA> copy(a_ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, cfg);
    EXPECT_EQ(copy.core().save_checkpoint(), root + "/A0/step-2");
  }
  const RunOutcome same_state = resume_on_a(root + "/A0/step-2", "A2");
  expect_continues(got, same_state, want);
  if (a_is_one_process) {
    ctx.barrier();
  }
}

using TpPlan64 = d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>, d9d::parallel::TensorParallel<>, Fp64>;
using TpFsdpPlan64 = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>,
                               d9d::parallel::TensorParallel<>, d9d::parallel::Fsdp, Fp64>;

// tp 2 -> tp 1: the one process continues the tp 2 run.
TEST(Parallel_Checkpoint_ws2, TensorParallelTwoResumedInOneProcessContinues) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    expect_resume_continues<TpPlan64, OneProcess>(env, R"({"tp": 2})", "", true);
  });
}

// tp 2 x FullyShard 2 -> FullyShard 4: the pieces (rows of tp slices) reassembled as rows.
TEST(Parallel_Checkpoint_ws4, TensorParallelTwoByFsdpTwoResumedOnFsdpFourContinues) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_resume_continues<TpFsdpPlan64, d9d::Plan<ShardMesh, d9d::parallel::Fsdp, Fp64>>(
        env, R"({"dp_shard": 2, "tp": 2})", "", false);
  });
}

TEST(Parallel_Checkpoint_ws4, FsdpFourToOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    expect_lossless_reshard<FsdpPlan, d9d::Plan<>>(env, "", "", true);
  });
}

}  // namespace
