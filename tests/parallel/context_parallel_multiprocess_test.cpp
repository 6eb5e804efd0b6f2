// Context parallelism (d9d::parallel::ContextParallel) on 2 and 4 Gloo ranks against one process
// training the same global batch, in float64 (tolerances in tests/train/train_test_util.hpp), 6
// optimizer steps each: cp 2 and cp 4 with both K/V rotations (all-gather, ring), packed documents
// with a separator, FullyShard x cp 2 (sharded over the cp ranks), cp_replicate 2, cp 2 x
// dp_replicate 2, cp 2 x FullyShard 2 (sharded over the 4 ranks), cp_shard 2 x cp_replicate 2
// under FullyShard, cp 2 x tp 2 (with and without sequence parallelism) and cp 2 x pp 2 (1F1B;
// ZB-H1 with FullyShard over cp); losses, gradient norms and every (gathered) parameter. Also the
// attention of a rank's chunks against SDPA over the whole sequence (outputs and the gradients of
// q, k, v; causal by the flash kernels and by the composed blocks, and with documents), the
// parameters' records and equality over cp, and the start-up and first-step errors.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/core/collectives.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;
using ::testing::HasSubstr;

using Cp = d9d::parallel::ContextParallel<>;
using CpRing = d9d::parallel::ContextParallel<d9d::parallel::KvRotation::ring>;
using Tp = d9d::parallel::TensorParallel<>;
using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
using CpMesh = d9d::mesh<d9d::cp_shard<d9d::dynamic>>;
using CpDpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>;
using CpShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>;
using CpTpMesh = d9d::mesh<d9d::cp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
using CpPpMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>;
using CpPpShardMesh =
    d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>;

// The id that ends a document in the documents runs (random tokens of 64 ids: about one window in
// four of 16 tokens holds one, at any place, so documents cross the chunk boundaries).
constexpr int64_t kSeparator = 7;

// 6 steps, global batch 8 in microbatches of 2, clipping at 0.5, 2 decoder layers of the tiny
// Qwen3 (4 heads, 2 KV heads), sequences of 16 tokens (cp 4: 8 chunks of 2).
d9d::TrainerConfig run_config(const std::string& dir, int64_t microbatch,
                              const std::string& mesh = "") {
  return tiny_run(dir, 6, 8, microbatch, false, 2, mesh);
}

d9d::CausalLmTask task(bool documents) {
  return documents ? d9d::CausalLmTask{d9d::CausalLmOptions{.document_separator = kSeparator}}
                   : d9d::CausalLmTask{};
}

template <class Plan>
RunOutcome train(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config,
                 bool documents = false) {
  d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             task(documents), config);
  return d9d::testing::outcome_of(trainer);
}

RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx, bool documents = false) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train<d9d::Plan<Fp64>>(
      local,
      run_config(env.scratch_dir() + "/one" + std::to_string(env.rank()) + (documents ? "d" : ""),
                 8),
      documents);
}

// context_attention over the cp ranks' chunks equals SDPA over the whole sequence: each rank's
// output rows and the gradients of its q, k and v chunks, causal and with packed documents.
void expect_attention_matches(const d9d::DeviceMesh& mesh, bool ring) {
  const auto group = d9d::parallel::detail::make_context_parallel_group(
      mesh.group(d9d::MeshDomain::batch, "cp"), ring);
  const int rank = group->rank();
  const int size = group->size();
  const int64_t tokens = 6LL * size;  // 2 · cp chunks of 3
  auto generator = at::detail::createCPUGenerator(11);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto q = at::randn({2, 4, tokens, 8}, generator, options);
  const auto k = at::randn({2, 2, tokens, 8}, generator, options);
  const auto v = at::randn({2, 2, tokens, 8}, generator, options);
  const auto upstream = at::randn({2, 4, tokens, 8}, generator, options);
  const d9d::model::RotaryEmbedding rope(8, 10000.0);
  // Documents of random lengths (a new one starts after ~1 token in 4), different per row.
  const auto starts = at::rand({2, tokens}, generator, options).lt(0.25).to(at::kLong);
  const auto where = d9d::model::place_documents(rope, starts.cumsum(1), at::kDouble);
  const auto mine = [&](const at::Tensor& x) {
    return d9d::model::context_shard(x, 2, rank, size);
  };
  // Causal: by the flash kernels (fused, the default) and by the composed blocks; documents: by
  // the composed blocks (the kernels take no mask).
  for (const auto& [documents, fused] :
       {std::pair{false, true}, std::pair{false, false}, std::pair{true, true}}) {
    d9d::model::set_fused_kernels(fused);
    const std::string what = std::string(ring ? "ring" : "all-gather") +
                             (documents ? ", documents"
                              : fused   ? ", causal, flash"
                                        : ", causal") +
                             ", cp " + std::to_string(size);
    const auto qf = q.clone().requires_grad_(true);
    const auto kf = k.clone().requires_grad_(true);
    const auto vf = v.clone().requires_grad_(true);
    const auto want = at::scaled_dot_product_attention(
        qf, kf, vf, documents ? std::optional<at::Tensor>(where.visible) : std::nullopt, 0.0,
        /*is_causal=*/!documents, std::nullopt, /*enable_gqa=*/true);
    (want * upstream).sum().backward();
    const auto ql = mine(q).requires_grad_(true);
    const auto kl = mine(k).requires_grad_(true);
    const auto vl = mine(v).requires_grad_(true);
    const auto got = d9d::model::context_attention(
        ql, kl, vl, documents ? mine(where.visible) : at::Tensor(), *group);
    (got * mine(upstream)).sum().backward();
    EXPECT_TRUE(at::allclose(got, mine(want), 0.0, 1e-12)) << what;
    EXPECT_TRUE(at::allclose(ql.grad(), mine(qf.grad()), 0.0, 1e-12)) << what;
    EXPECT_TRUE(at::allclose(kl.grad(), mine(kf.grad()), 0.0, 1e-12)) << what;
    EXPECT_TRUE(at::allclose(vl.grad(), mine(vf.grad()), 0.0, 1e-12)) << what;
  }
  d9d::model::set_fused_kernels(true);
}

// Every parameter is the same on the cp ranks and recorded as replicated over cp.
void expect_replicated_over_cp(d9d::detail::TrainerCore& core) {
  const auto cp = core.mesh().group(d9d::MeshDomain::batch, "cp");
  for (const auto& record : core.parallel().parameters()) {
    EXPECT_NE(std::find(record.dims.begin(), record.dims.end(), "cp_shard"), record.dims.end())
        << record.name;
    const auto all = d9d::all_gather(cp, record.local.detach());
    for (const auto& other : all) {
      EXPECT_TRUE(at::equal(other, all[0])) << record.name << " differs over cp";
    }
  }
}

// FullyShard under cp shards over dp_shard x cp_shard (the dense domain's dp_cp_shard): `ranks`
// rows-shards of the [32, 32] q projection.
void expect_sharded_over_dp_cp(d9d::detail::TrainerCore& core, int64_t ranks) {
  const auto* q = core.parallel().find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->domain, d9d::MeshDomain::dense);
  EXPECT_EQ(q->dims, (std::vector<std::string>{"dp_replicate", "cp_replicate", "dp_cp_shard"}));
  EXPECT_EQ(q->local.sizes().vec(), (std::vector<int64_t>{32 / ranks, 32}));
}

TEST(Parallel_ContextParallel_cp2, MatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.cp_shard = 2});
    expect_attention_matches(mesh, /*ring=*/false);
    expect_attention_matches(mesh, /*ring=*/true);
    const auto want = reference(env, ctx);
    d9d::Trainer<d9d::Plan<CpMesh, Cp, Fp64>> trainer(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        run_config(dir + "/gather", 2, R"({"cp_shard": 2})"));
    const RunOutcome got = d9d::testing::outcome_of(trainer);
    expect_replicated_over_cp(trainer.core());
    d9d::testing::expect_same_run(got, want, "cp 2, all-gather");
    d9d::testing::expect_same_run(train_plan<d9d::Plan<CpMesh, CpRing, Fp64>>(
                                      ctx, run_config(dir + "/ring", 2, R"({"cp_shard": 2})")),
                                  want, "cp 2, ring");
    // FullyShard x cp 2 on 2 ranks: the parameters sharded over the cp ranks (dp_cp_shard = 2).
    d9d::Trainer<d9d::Plan<CpShardMesh, Cp, d9d::parallel::Fsdp, Fp64>> sharded(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        run_config(dir + "/fsdp", 2, R"({"dp_shard": 1, "cp_shard": 2})"));
    const RunOutcome sharded_got = d9d::testing::outcome_of(sharded);
    expect_sharded_over_dp_cp(sharded.core(), 2);
    d9d::testing::expect_same_run(sharded_got, want, "FullyShard x cp 2");
    // cp_replicate splits the sequence as cp_shard does (without FullyShard nothing differs).
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<d9d::mesh<d9d::cp_replicate<d9d::dynamic>>, Cp, Fp64>>(
            ctx, run_config(dir + "/replicate", 2, R"({"cp_replicate": 2})")),
        want, "cp_replicate 2");
    // Packed documents: positions restart and attention stops at each separator, across chunks.
    const auto documents = reference(env, ctx, /*documents=*/true);
    d9d::testing::expect_same_run(
        train<d9d::Plan<CpMesh, Cp, Fp64>>(ctx, run_config(dir + "/docs", 2, R"({"cp_shard": 2})"),
                                           /*documents=*/true),
        documents, "cp 2, all-gather, documents");
    d9d::testing::expect_same_run(
        train<d9d::Plan<CpMesh, CpRing, Fp64>>(
            ctx, run_config(dir + "/docs_ring", 2, R"({"cp_shard": 2})"), /*documents=*/true),
        documents, "cp 2, ring, documents");
  });
}

TEST(Parallel_ContextParallel_cp2, RefusesWhatItCannotSplit) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    // 18 tokens do not split into 4 chunks: the first step names the sizes and the key.
    auto odd = run_config(dir + "/odd", 2, R"({"cp_shard": 2})");
    odd.batch.sequence_length = 18;
    try {
      (void)train_plan<d9d::Plan<CpMesh, Cp, Fp64>>(ctx, odd);
      ADD_FAILURE() << "a sequence of 18 tokens over cp 2 did not fail";
    } catch (const std::exception& error) {
      EXPECT_THAT(error.what(), HasSubstr("over cp = 2 ranks each sequence is cut into 4 chunks"));
      EXPECT_THAT(error.what(), HasSubstr("set \"batch.sequence_length\" to a multiple of 4"));
    }
    // cp 1 under ContextParallel: nothing to split.
    try {
      (void)train_plan<d9d::Plan<CpMesh, Cp, Fp64>>(
          d9d::DistributedContext::local({.device = ctx.device().str()}),
          run_config(dir + "/one", 2, R"({"cp_shard": 1})"));
      ADD_FAILURE() << "ContextParallel over cp 1 did not fail";
    } catch (const std::exception& error) {
      EXPECT_THAT(error.what(), HasSubstr("nothing to split the sequence over"));
    }
    // cp 2 without the policy.
    try {
      (void)train_plan<d9d::Plan<CpMesh, Fp64>>(ctx,
                                                run_config(dir + "/none", 2, R"({"cp_shard": 2})"));
      ADD_FAILURE() << "cp 2 without ContextParallel did not fail";
    } catch (const std::exception& error) {
      EXPECT_THAT(error.what(), HasSubstr("d9d::parallel::NoContextParallel"));
    }
  });
}

TEST(Parallel_ContextParallel_ws4, Cp4AndTimesReplicateFullyShardTensorAndPipelineMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.cp_shard = 4});
    expect_attention_matches(mesh, /*ring=*/false);
    expect_attention_matches(mesh, /*ring=*/true);
    const auto want = reference(env, ctx);
    d9d::testing::expect_same_run(train_plan<d9d::Plan<CpMesh, Cp, Fp64>>(
                                      ctx, run_config(dir + "/gather", 2, R"({"cp_shard": 4})")),
                                  want, "cp 4, all-gather");
    d9d::testing::expect_same_run(train_plan<d9d::Plan<CpMesh, CpRing, Fp64>>(
                                      ctx, run_config(dir + "/ring", 2, R"({"cp_shard": 4})")),
                                  want, "cp 4, ring");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<CpDpMesh, CpRing, Fp64>>(
            ctx, run_config(dir + "/dp", 2, R"({"dp_replicate": 2, "cp_shard": 2})")),
        want, "cp 2 x dp_replicate 2, ring");
    d9d::Trainer<d9d::Plan<CpShardMesh, Cp, d9d::parallel::Fsdp, Fp64>> sharded(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        run_config(dir + "/fsdp", 2, R"({"dp_shard": 2, "cp_shard": 2})"));
    const RunOutcome got = d9d::testing::outcome_of(sharded);
    expect_sharded_over_dp_cp(sharded.core(), 4);
    d9d::testing::expect_same_run(got, want, "cp 2 x FullyShard 2");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<CpTpMesh, Tp, Cp, Fp64>>(
            ctx, run_config(dir + "/tp", 2, R"({"cp_shard": 2, "tp": 2})")),
        want, "cp 2 x tp 2");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<CpTpMesh, TpSp, CpRing, Fp64>>(
            ctx, run_config(dir + "/sp", 2, R"({"cp_shard": 2, "tp": 2})")),
        want, "cp 2 x tp 2 with sequence parallelism, ring");
    // FullyShard over dp_shard x cp_shard, replicated over cp_replicate: the sequence split 4 ways.
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>,
                                       d9d::cp_replicate<d9d::dynamic>>,
                             Cp, d9d::parallel::Fsdp, Fp64>>(
            ctx,
            run_config(dir + "/hsdp", 2, R"({"dp_shard": 1, "cp_shard": 2, "cp_replicate": 2})")),
        want, "cp_shard 2 x cp_replicate 2, FullyShard over cp_shard");
    // Pipelines: 4 microbatches of 2 through pp 2; each stage attends over its cp group.
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<CpPpMesh, d9d::pipeline::OneFOneB<>, Cp, Fp64>>(
            ctx, run_config(dir + "/pp", 2, R"({"pp": 2, "cp_shard": 2})")),
        want, "cp 2 x pp 2 (1F1B), all-gather");
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<CpPpShardMesh, d9d::pipeline::ZeroBubbleH1<>, CpRing,
                             d9d::parallel::Fsdp, Fp64>>(
            ctx, run_config(dir + "/ppfsdp", 2, R"({"pp": 2, "dp_shard": 1, "cp_shard": 2})")),
        want, "cp 2 x pp 2 (ZB-H1) x FullyShard over cp, ring");
  });
}

}  // namespace
