// Tensor parallelism (d9d::parallel::TensorParallel) on 2 and 4 Gloo ranks against one process
// training the same global batch, in float64 (tolerances in tests/train/train_test_util.hpp), 6
// optimizer steps each: tp 2, tp 2 x dp_replicate 2 and tp 2 x FullyShard 2 (dp_shard), each with
// an untied and a tied LM head, tp 2 with sequence parallelism (alone and x FullyShard 2),
// tp 2 x pp 2 (1F1B, ZeroBubbleH1; the last stage's logits split for the loss-parallel
// cross-entropy, or gathered for a task that does not take the vocabulary part), with sequence
// parallelism too, and, on 8 ranks, tp 2 x FullyShard 2 x pp 2 (1F1B, ~3 s here);
// losses, gradient norms and
// every (gathered) parameter. Also the loss-parallel cross-entropy against the full one (values and
// gradients, ignore index included), the model's gathered logits, replicated parameters staying
// identical over tp, the start-up rules, and CUDA graphs of tp's microbatches (replayed on GPUs).
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/advise/memory_meter.hpp>
#include <d9d/core/collectives.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/model/layers.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;
using ::testing::HasSubstr;

using Tp = d9d::parallel::TensorParallel<>;
using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;
using TpDpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
using TpShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
using TpPpMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
using TpShardPpMesh =
    d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;

// 6 steps, global batch 8 in microbatches of 2 (accumulation on every rank), clipping at 0.5,
// 2 decoder layers of the tiny Qwen3 (4 heads, 2 KV heads, intermediate 64, vocabulary 64).
d9d::TrainerConfig run_config(const std::string& dir, bool tied, int64_t microbatch,
                              const std::string& mesh = "") {
  auto config = tiny_run(dir, 6, 8, microbatch, false, 2, mesh);
  config.sections["model"] = d9d::testing::tiny_qwen3_json(tied, 2);
  return config;
}

// The causal LM task, recording the width of the last stage's logits it gets; with
// `TakesVocab` it has CausalLmTask's output_loss(logits, batch, part, vocab), so under tensor
// parallelism the pipelined step keeps the logits split (the loss-parallel cross-entropy), else
// only output_loss(logits, batch), and the step gathers them.
template <bool TakesVocab>
class LogitsWidthTask {
 public:
  using train_task_concept = d9d::train_task_tag;
  static inline int64_t seen = 0;  // the last output_loss's logits width on this rank
  d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& model,
                               const d9d::CausalLmBatch& batch) {
    return task_.compute_loss(model, batch);
  }
  at::Tensor stage_input(const d9d::CausalLmBatch& batch) { return task_.stage_input(batch); }
  d9d::LossOutput output_loss(const at::Tensor& logits, const d9d::CausalLmBatch& batch) {
    seen = logits.size(-1);
    return task_.output_loss(logits, batch);
  }
  d9d::LossOutput output_loss(const at::Tensor& logits, const d9d::CausalLmBatch& batch,
                              const d9d::SequencePart& part,
                              const d9d::VocabPart& vocab) requires TakesVocab {
    seen = logits.size(-1);
    return task_.output_loss(logits, batch, part, vocab);
  }

 private:
  d9d::CausalLmTask task_;
};

// tp 2 x pp 2 with `Strategy` under 1F1B and ZeroBubbleH1 (weight gradients of the split
// projections in W actions), each against one process; every rank compares its stage's
// parameters.
template <class Strategy>
void expect_pipelines_match(const d9d::DistributedContext& ctx, const std::string& dir,
                            const RunOutcome& want, const std::string& what) {
  const std::string mesh = R"({"pp": 2, "tp": 2})";
  d9d::testing::expect_same_run(
      train_plan<d9d::Plan<TpPpMesh, Strategy, d9d::pipeline::OneFOneB<>, Fp64>>(
          ctx, run_config(dir + "_1f1b", false, 2, mesh)),
      want, what + ", 1F1B");
  d9d::testing::expect_same_run(
      train_plan<d9d::Plan<TpPpMesh, Strategy, d9d::pipeline::ZeroBubbleH1<>, Fp64>>(
          ctx, run_config(dir + "_zb", false, 2, mesh)),
      want, what + ", ZeroBubbleH1");
}

RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx, bool tied) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_plan<d9d::Plan<Fp64>>(
      local, run_config(env.scratch_dir() + "/one" + std::to_string(env.rank()) +
                            (tied ? "tied" : "untied"),
                        tied, 8));
}

// Every parameter replicated over tp is bit-identical on the tp ranks (the norms' gradients are
// whole on each rank, or summed over tp).
void expect_replicas_identical(d9d::detail::TrainerCore& core) {
  const auto& mesh = core.mesh();
  const auto tp = mesh.group(d9d::MeshDomain::regular, "tp");
  int replicated = 0;
  for (const auto& record : core.parallel().parameters()) {
    if (!record.sharded_dims().empty()) {
      continue;
    }
    ++replicated;
    const auto all = d9d::all_gather(tp, record.local.detach());
    for (const auto& other : all) {
      EXPECT_TRUE(at::equal(other, all[0])) << record.name << " differs over tp";
    }
  }
  EXPECT_GT(replicated, 0);
}

// The records: split parameters are Shard(d) on tp with the whole shape, norms Replicate.
void expect_records(d9d::detail::TrainerCore& core, bool tied) {
  const auto* q = core.parallel().find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->sharded_dims(), std::vector<std::string>{"tp"});
  EXPECT_EQ(q->global_shape, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(q->local.sizes().vec(), (std::vector<int64_t>{16, 32}));
  const auto* o = core.parallel().find("model.layers.0.self_attn.o_proj.weight");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->local.sizes().vec(), (std::vector<int64_t>{32, 16}));
  const auto* down = core.parallel().find("model.layers.1.mlp.down_proj.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->local.sizes().vec(), (std::vector<int64_t>{32, 32}));
  const auto* embed = core.parallel().find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->local.sizes().vec(), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(core.parallel().find("lm_head.weight") != nullptr, !tied);
  const auto* q_norm = core.parallel().find("model.layers.0.self_attn.q_norm.weight");
  ASSERT_NE(q_norm, nullptr);
  EXPECT_TRUE(q_norm->sharded_dims().empty());
}

// The loss-parallel cross-entropy equals the full one on random logits whose labels include
// ignored rows and ids of every rank's slice: the summed loss and the logits' gradients.
void expect_loss_parallel_equals_full(const d9d::DeviceMesh& mesh) {
  const auto group =
      d9d::parallel::detail::make_tensor_parallel_group(mesh.group(d9d::MeshDomain::regular, "tp"));
  const int64_t rows = 24;
  const int64_t vocab = 64;
  auto generator = at::detail::createCPUGenerator(17);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto logits = (at::randn({rows, vocab}, generator, options) * 4.0);
  auto labels = at::randint(vocab, {rows}, generator, at::kLong);
  labels.index_fill_(0, at::arange(0, rows, 5), -100);
  const auto full = logits.clone().requires_grad_(true);
  const auto want = d9d::model::causal_lm_loss(full, labels);
  want.loss_sum.backward();
  const int64_t part = vocab / group->size();
  const int64_t start = part * group->rank();
  const auto mine = logits.narrow(1, start, part).clone().requires_grad_(true);
  const auto got = group->cross_entropy_sum(mine, labels, start, -100);
  got.backward();
  EXPECT_NEAR(got.item<double>(), want.loss_sum.item<double>(),
              1e-12 * std::abs(want.loss_sum.item<double>()));
  EXPECT_TRUE(at::allclose(mine.grad(), full.grad().narrow(1, start, part), 0.0, 1e-13))
      << (mine.grad() - full.grad().narrow(1, start, part)).abs().max().item<double>();
  // float32 logits give a float32 loss, as the unsplit loss does.
  EXPECT_EQ(
      group->cross_entropy_sum(mine.detach().to(at::kFloat), labels, start, -100).scalar_type(),
      at::kFloat);
}

// bfloat16 logits: the gradient is the float32 one rounded once to bfloat16, and the backward
// allocates only that gradient (no float32 product of the logits' size beside the saved float32
// softmax − one-hot, which was the bf16 tensor-parallel step's peak).
void expect_bf16_loss_parallel_backward(const d9d::DeviceMesh& mesh) {
  const auto group =
      d9d::parallel::detail::make_tensor_parallel_group(mesh.group(d9d::MeshDomain::regular, "tp"));
  const int64_t rows = 256;
  const int64_t vocab = 512;
  auto generator = at::detail::createCPUGenerator(29);
  const auto logits = (at::randn({rows, vocab}, generator, at::kFloat) * 4.0).to(at::kBFloat16);
  auto labels = at::randint(vocab, {rows}, generator, at::kLong);
  labels.index_fill_(0, at::arange(0, rows, 7), -100);
  const int64_t part = vocab / group->size();
  const int64_t start = part * group->rank();
  const auto wide = logits.narrow(1, start, part).to(at::kFloat).requires_grad_(true);
  (group->cross_entropy_sum(wide, labels, start, -100) * 0.37).backward();
  const auto narrow = logits.narrow(1, start, part).clone().requires_grad_(true);
  const auto loss = group->cross_entropy_sum(narrow, labels, start, -100) * 0.37;
  int64_t allocated = 0;
  {
    d9d::advise::CpuMemoryMeter meter;
    loss.backward();
    allocated = meter.peak();
  }
  ASSERT_EQ(narrow.grad().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(narrow.grad(), wide.grad().to(at::kBFloat16)));
  const auto gradient = static_cast<int64_t>(narrow.grad().nbytes());
  EXPECT_GE(allocated, gradient);
  // The product in float32 would add rows x part x 4 bytes; a few small blocks (the seed gradient,
  // the scale's) are allowed.
  EXPECT_LT(allocated, gradient + 4096) << "the backward allocated " << allocated << " bytes";
  // Its backward hands the saved gradient over, so a second backward through a retained graph
  // says so instead of scaling it twice.
  const auto again = logits.narrow(1, start, part).clone().requires_grad_(true);
  const auto retained = group->cross_entropy_sum(again, labels, start, -100);
  retained.backward({}, /*retain_graph=*/true);
  EXPECT_THAT([&] { retained.backward(); },
              testing::ThrowsMessage<std::exception>(testing::HasSubstr("ran twice")));
}

// The model under tp 2 gives the one-process logits (gathered) and loss.
void expect_model_matches(const d9d::DistributedContext& ctx, bool tied) {
  const auto config = d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(tied));
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM whole(config);
  whole->to(at::kDouble);
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM split(config);
  auto mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.tp = 2});
  auto parallel = d9d::parallel::parallelize<d9d::Plan<TpMesh, Tp, Fp64>>(mesh, {split.ptr()});
  auto generator = at::detail::createCPUGenerator(23);
  const auto ids = at::randint(64, {2, 16}, generator, at::kLong);
  const auto labels = at::randint(64, {2, 16}, generator, at::kLong);
  EXPECT_TRUE(at::allclose(split->forward(ids), whole->forward(ids), 0.0, 1e-12));
  const auto got = split->loss(ids, labels);
  const auto want = whole->loss(ids, labels);
  EXPECT_NEAR(got.loss_sum.item<double>(), want.loss_sum.item<double>(),
              1e-12 * want.loss_sum.item<double>());
  EXPECT_EQ(got.tokens.item<int64_t>(), want.tokens.item<int64_t>());
  // Sequence parallel: the hidden states between blocks are this rank's 16 of the 2 x 16 tokens,
  // shaped [2, 8, 32]: the run of tokens [16 r, 16 r + 16) taken sequence after sequence (rank 0
  // holds the first sequence, rank 1 the second), not 8 tokens of each sequence.
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM sequence(config);
  auto sp = d9d::parallel::parallelize<d9d::Plan<TpMesh, TpSp, Fp64>>(mesh, {sequence.ptr()});
  const auto shard = sequence->model->forward(ids);
  EXPECT_EQ(shard.sizes().vec(), (std::vector<int64_t>{2, 8, 32}));
  const int64_t rank = mesh.coordinate(d9d::MeshDomain::regular, "tp");
  const auto tokens = whole->model->forward(ids).flatten(0, 1).narrow(0, 16 * rank, 16);
  EXPECT_TRUE(at::allclose(shard, tokens.view({2, 8, 32}), 0.0, 1e-12));
  EXPECT_TRUE(at::allclose(sequence->forward(ids), whole->forward(ids), 0.0, 1e-12));
  EXPECT_NEAR(sequence->loss(ids, labels).loss_sum.item<double>(), want.loss_sum.item<double>(),
              1e-12 * want.loss_sum.item<double>());
}

// The overlapped column- and row-parallel blocks of sequence parallelism equal the plain ones:
// fan_out_linear_gathered against fan_out_linear(copy_in(x)), linear_scattered against
// reduce_out(linear(h)), silu_mul_linear_scattered against reduce_out(linear(silu(gate) * up)):
// outputs, input gradients and weight gradients, with the weight gradients computed in backward
// and deferred to a WeightGradQueue (ZeroBubble's split backward), for microbatches of 2 x 8
// tokens (8 rows per rank: the scatter in two parts), 1 x 6 (3 rows: one part) and 2 x 1024.
void expect_overlapped_blocks_equal_plain(const d9d::DeviceMesh& mesh) {
  const auto group = d9d::parallel::detail::make_tensor_parallel_group(
      mesh.group(d9d::MeshDomain::regular, "tp"), /*sequence_parallel=*/true);
  const int64_t ranks = group->size();
  const int64_t rank = group->rank();
  auto generator = at::detail::createCPUGenerator(29);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  torch::manual_seed(5);
  d9d::model::Linear q(4, 6, false);
  d9d::model::Linear k(4, 2, false);
  d9d::model::Linear o(6, 4, false);
  d9d::model::Linear down(6, 4, false);
  for (auto* layer : {q.get(), k.get(), o.get(), down.get()}) {
    layer->to(at::kDouble);
  }
  const auto weight_grads = [&] {
    std::vector<at::Tensor> grads;
    for (auto* layer : {q.get(), k.get(), o.get(), down.get()}) {
      grads.push_back(layer->weight.grad().defined() ? layer->weight.grad().clone()
                                                     : at::zeros_like(layer->weight));
      layer->weight.mutable_grad() = at::Tensor();
    }
    return grads;
  };
  for (const auto& [batch, tokens] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 8}, {1, 6}, {2, 1024}}) {
    const int64_t rows = batch * tokens / ranks;
    // The same whole microbatch on every rank; this rank's shard is its run of rows.
    const auto whole = at::randn({batch, tokens, 4}, generator, options);
    const auto shard = whole.flatten(0, 1).narrow(0, rows * rank, rows).view({batch, -1, 4});
    const auto coefficients = at::randn({batch, tokens, 8}, generator, options);
    // A different partial input of the row-parallel layer on each rank.
    const auto partial = at::randn({batch, tokens, 6}, generator, options) * (1.0 + rank);
    // The feed-forward's gate and up, different on each rank.
    const auto gate = at::randn({batch, tokens, 6}, generator, options) - 0.5 * rank;
    const auto up = at::randn({batch, tokens, 6}, generator, options);
    const auto shard_coefficients =
        at::randn({batch * tokens, 4}, generator, options).narrow(0, rows * rank, rows);
    for (const bool deferred : {false, true}) {
      const auto run = [&](bool overlapped) {
        d9d::WeightGradQueue queue;
        const auto x = shard.clone().requires_grad_(true);
        const auto h = partial.clone().requires_grad_(true);
        const auto g = gate.clone().requires_grad_(true);
        const auto u = up.clone().requires_grad_(true);
        std::vector<at::Tensor> ys;
        at::Tensor z;
        at::Tensor f;
        {
          std::optional<d9d::RecordWeightGrads> record;
          if (deferred) {
            record.emplace(queue);
          }
          ys = overlapped ? d9d::model::fan_out_linear_gathered(x, {q.get(), k.get()}, *group)
                          : d9d::model::fan_out_linear(group->copy_in(x), {q.get(), k.get()});
          z = overlapped ? d9d::model::linear_scattered(h, *o, *group) : group->reduce_out(o(h));
          f = overlapped ? d9d::model::silu_mul_linear_scattered(g, u, *down, *group)
                         : group->reduce_out(down(at::silu(g) * u));
        }
        const auto y = at::cat({ys[0], ys[1]}, -1);
        const auto loss = (y * coefficients).sum() +
                          (z.reshape({rows, 4}) * shard_coefficients).sum() +
                          (f.reshape({rows, 4}) * shard_coefficients.flip(0)).sum();
        {
          std::optional<d9d::DeferWeightGrads> defer;
          if (deferred) {
            defer.emplace(queue);
          }
          loss.backward();
        }
        EXPECT_EQ(queue.empty(), !deferred);
        queue.drain();
        return std::make_tuple(y.detach(), z.detach(), f.detach(), x.grad(), h.grad(),
                               at::cat({g.grad(), u.grad()}, -1), weight_grads());
      };
      const auto [y_plain, z_plain, f_plain, dx_plain, dh_plain, dgu_plain, dw_plain] = run(false);
      const auto [y, z, f, dx, dh, dgu, dw] = run(true);
      const std::string where = "rank " + std::to_string(rank) + ", " + std::to_string(batch) +
                                " x " + std::to_string(tokens) + (deferred ? ", deferred" : "");
      EXPECT_EQ(y.sizes(), y_plain.sizes()) << where;
      EXPECT_EQ(z.sizes(), z_plain.sizes()) << where;
      EXPECT_TRUE(at::allclose(y, y_plain, 0.0, 1e-13)) << where;
      EXPECT_TRUE(at::allclose(z, z_plain, 0.0, 1e-13)) << where;
      EXPECT_EQ(f.sizes(), f_plain.sizes()) << where;
      EXPECT_TRUE(at::allclose(f, f_plain, 0.0, 1e-13)) << where;
      EXPECT_TRUE(at::allclose(dgu, dgu_plain, 0.0, 1e-13)) << where;
      EXPECT_TRUE(at::allclose(dx, dx_plain, 0.0, 1e-13)) << where;
      EXPECT_TRUE(at::allclose(dh, dh_plain, 0.0, 1e-13)) << where;
      for (size_t i = 0; i < dw.size(); ++i) {
        EXPECT_TRUE(at::allclose(dw[i], dw_plain[i], 0.0, 1e-13)) << where << ", weight " << i;
        EXPECT_GT(dw[i].abs().sum().item<double>(), 0.0) << where << ", weight " << i;
      }
    }
  }
}

TEST(Parallel_TensorParallel_tp2, MatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    expect_loss_parallel_equals_full(d9d::DeviceMesh(ctx, d9d::MeshShape{.tp = 2}));
    expect_bf16_loss_parallel_backward(d9d::DeviceMesh(ctx, d9d::MeshShape{.tp = 2}));
    expect_overlapped_blocks_equal_plain(d9d::DeviceMesh(ctx, d9d::MeshShape{.tp = 2}));
    for (const bool tied : {false, true}) {
      expect_model_matches(ctx, tied);
      const auto want = reference(env, ctx, tied);
      d9d::Trainer<d9d::Plan<TpMesh, Tp, Fp64>> trainer(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          run_config(dir + (tied ? "/tied" : "/untied"), tied, 2, R"({"tp": 2})"));
      const RunOutcome got = d9d::testing::outcome_of(trainer);
      expect_records(trainer.core(), tied);
      expect_replicas_identical(trainer.core());
      d9d::testing::expect_same_run(got, want, tied ? "tp 2, tied head" : "tp 2, untied head");
      // Sequence parallel: the residual stream split by sequence, the norms' gradients summed.
      d9d::Trainer<d9d::Plan<TpMesh, TpSp, Fp64>> sp(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          run_config(dir + (tied ? "/sp_tied" : "/sp_untied"), tied, 2, R"({"tp": 2})"));
      const RunOutcome sp_got = d9d::testing::outcome_of(sp);
      expect_replicas_identical(sp.core());
      d9d::testing::expect_same_run(
          sp_got, want,
          tied ? "tp 2 + sequence parallel, tied head" : "tp 2 + sequence parallel, untied head");
    }
  });
}

// Tensor parallelism lets a CUDA graph capture a microbatch (its collectives are stream-ordered
// calls, no hooks), with and without sequence parallelism. On GPUs (D9D_TEST_BACKEND=nccl): the
// graphed run of tp 2 + sequence parallel replays its microbatches and equals the eager run
// (float64: losses, gradient norms and parameters to the training tests' tolerances).
TEST(Parallel_TensorParallel_tp2, CudaGraphsCaptureTheCollectives) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.tp = 2});
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2));
    const auto blocker = [&](auto plan) {
      d9d::model::Qwen3ForCausalLM model(config);
      model->to(ctx.device());
      return d9d::parallel::parallelize<decltype(plan)>(mesh, {model.ptr()})->graph_blocker();
    };
    EXPECT_EQ(blocker(d9d::Plan<TpMesh, Tp, Fp64>{}), "");
    EXPECT_EQ(blocker(d9d::Plan<TpMesh, TpSp, Fp64>{}), "");
    EXPECT_EQ(blocker(d9d::Plan<TpDpMesh, TpSp, Fp64>{}), "");  // dp_replicate 1: no all-reduce
    if (!ctx.device().is_cuda()) {
      return;  // graphs need a CUDA device (the step says so: Train_CudaGraphs)
    }
    const std::string dir = env.scratch_dir() + "/graphs" + std::to_string(env.rank());
    const auto run = [&](bool graphs) {
      auto cfg = run_config(dir + (graphs ? "/on" : "/off"), false, 2, R"({"tp": 2})");
      cfg.cuda_graphs.enabled = graphs;
      d9d::Trainer<d9d::Plan<TpMesh, TpSp, Fp64>> trainer(ctx, d9d::Qwen3Provider{},
                                                          d9d::testing::RandomWindowsProvider{},
                                                          d9d::CausalLmTask{}, cfg);
      return d9d::testing::outcome_of(trainer);
    };
    const auto eager = run(false);
    const auto graphed = run(true);
    EXPECT_EQ(eager.result.graph_replays, 0);
    EXPECT_EQ(graphed.result.graph_replays, 5 * 4);  // steps 1 to 5, 4 microbatches each
    d9d::testing::expect_same_run(graphed, eager, "tp 2 + sequence parallel, CUDA graphs");
  });
}

// The export gathers each split parameter (tied head included) and writes the whole model, equal
// to the gathered shards, which loads as a Qwen3.
TEST(Parallel_TensorParallel_tp2, ExportsTheWholeModel) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    auto config =
        tiny_run(env.scratch_dir() + "/run", 2, 8, 2, /*outputs=*/true, 2, R"({"tp": 2})");
    config.sections["model"] = d9d::testing::tiny_qwen3_json(/*tied=*/true, 2);
    config.logging.progress = false;
    d9d::Trainer<d9d::Plan<TpMesh, Tp>> trainer(ctx, d9d::Qwen3Provider{},
                                                d9d::testing::RandomWindowsProvider{},
                                                d9d::CausalLmTask{}, config);
    const auto result = trainer.train();
    const auto parameters = d9d::testing::full_parameters(trainer.core());
    if (env.rank() != 0) {
      return;
    }
    d9d::testing::expect_exported_equals(*d9d::model::load_hf_qwen3(result.export_dir), parameters);
  });
}

TEST(Parallel_TensorParallel_ws4, TimesReplicateFullyShardAndPipelineMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    for (const bool tied : {false, true}) {
      const auto want = reference(env, ctx, tied);
      d9d::testing::expect_same_run(
          train_plan<d9d::Plan<TpDpMesh, Tp, Fp64>>(
              ctx, run_config(dir + (tied ? "/tied" : "/untied"), tied, 2,
                              R"({"dp_replicate": 2, "tp": 2})")),
          want, tied ? "tp 2 x dp_replicate 2, tied" : "tp 2 x dp_replicate 2, untied");
      // FullyShard shards the tp shards over dp_shard (records Shard on tp and dp_shard).
      d9d::Trainer<d9d::Plan<TpShardMesh, Tp, d9d::parallel::Fsdp, Fp64>> sharded(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          run_config(dir + (tied ? "/fsdp_tied" : "/fsdp_untied"), tied, 2,
                     R"({"dp_shard": 2, "tp": 2})"));
      const RunOutcome got = d9d::testing::outcome_of(sharded);
      const auto* q = sharded.core().parallel().find("model.layers.0.self_attn.q_proj.weight");
      ASSERT_NE(q, nullptr);
      EXPECT_EQ(q->dims, (std::vector<std::string>{"dp_replicate", "tp", "dp_shard"}));
      EXPECT_EQ(q->local.sizes().vec(), (std::vector<int64_t>{8, 32}));
      d9d::testing::expect_same_run(
          got, want, tied ? "tp 2 x FullyShard 2, tied" : "tp 2 x FullyShard 2, untied");
      if (tied) {
        continue;  // several pipeline stages need an untied head
      }
      // Sequence parallel x FullyShard.
      d9d::testing::expect_same_run(
          train_plan<d9d::Plan<TpShardMesh, TpSp, d9d::parallel::Fsdp, Fp64>>(
              ctx, run_config(dir + "/sp_fsdp", false, 2, R"({"dp_shard": 2, "tp": 2})")),
          want, "tp 2 + sequence parallel x FullyShard 2");
      expect_pipelines_match<Tp>(ctx, dir + "/pp", want, "tp 2 x pp 2");
      // The loss under tp x pp: split logits and the loss-parallel cross-entropy for a task that
      // takes the vocabulary part (CausalLmTask does; the runs above used it), gathered logits
      // for one that does not. Ranks of the last stage see 32 or 64 of the 64 ids; others none.
      using SplitTask = LogitsWidthTask<true>;
      using WholeTask = LogitsWidthTask<false>;
      using OneFOneBPlan = d9d::Plan<TpPpMesh, Tp, d9d::pipeline::OneFOneB<>, Fp64>;
      d9d::testing::expect_same_run(
          train_plan<OneFOneBPlan, SplitTask>(
              ctx, run_config(dir + "/pp_split", false, 2, R"({"pp": 2, "tp": 2})")),
          want, "tp 2 x pp 2, loss-parallel cross-entropy");
      d9d::testing::expect_same_run(
          train_plan<OneFOneBPlan, WholeTask>(
              ctx, run_config(dir + "/pp_whole", false, 2, R"({"pp": 2, "tp": 2})")),
          want, "tp 2 x pp 2, gathered logits");
      EXPECT_EQ(SplitTask::seen == 0, WholeTask::seen == 0);  // the same ranks hold the last stage
      if (SplitTask::seen != 0) {
        EXPECT_EQ(SplitTask::seen, 32);
        EXPECT_EQ(WholeTask::seen, 64);
      }
      // Sequence parallel x pp 2: the stages pass each rank's T / tp tokens.
      expect_pipelines_match<TpSp>(ctx, dir + "/sp_pp", want, "tp 2 + sequence parallel x pp 2");
    }
    // tp 4 does not divide the 2 KV heads: a configuration error (run_main's exit status 2)
    // naming the config key.
    try {
      (void)train_plan<d9d::Plan<TpMesh, Tp, Fp64>>(
          ctx, run_config(dir + "/tp4", false, 2, R"({"tp": 4})"));
      ADD_FAILURE() << "tp 4 over 2 KV heads did not fail";
    } catch (const d9d::ConfigError& error) {
      EXPECT_THAT(error.what(), HasSubstr("\"mesh.tp\" = 4 does not divide the model's "
                                          "\"num_key_value_heads\" = 2"));
    }
  });
}

// All three on 8 ranks: tp 2 x FullyShard 2 x pp 2 (1F1B), each rank its stage's rows of its tp
// slices, against one process over the 6 steps.
TEST(Parallel_TensorParallel_ws8, TimesFullyShardTimesPipelineMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(8);
  d9d::testing::run_on_ranks({.world_size = 8}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    d9d::testing::expect_same_run(
        train_plan<
            d9d::Plan<TpShardPpMesh, Tp, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(
            ctx, run_config(dir + "/all", false, 2, R"({"pp": 2, "dp_shard": 2, "tp": 2})")),
        reference(env, ctx, false), "tp 2 x FullyShard 2 x pp 2, 1F1B");
  });
}

}  // namespace
