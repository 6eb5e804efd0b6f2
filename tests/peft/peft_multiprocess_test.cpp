// LoRA with the parallel strategies on 2 and 4 ranks (Gloo, or NCCL with D9D_TEST_BACKEND=nccl)
// against one process training the same global batch, in float64 (tolerances: tests/train/
// train_test_util.hpp): under FullyShard over 2 ranks, in a pipeline of 2 stages (1F1B, and
// ZeroBubbleH1, whose W actions compute the adapters' weight gradients), and under tensor
// parallelism (tp 2, with sequence parallelism, tp 2 x FullyShard 2, tp 2 x pp 2): losses,
// gradient norms, trained parameters, the frozen base (gathered from its tp shards, unchanged) and
// the exported adapter and merged model (also from the pipelines). Also the adapters' gradients
// under tp 2 against one process (the split factors' are slices, the whole factors' partial sums
// over tp) and a training checkpoint of LoRA under tp 2 resumed in one process and back.
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/core/collectives.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/state/safetensors.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"

namespace {

using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;

using d9d::precision::Fp64;
namespace peft = d9d::peft;

// Adapters on every linear layer but the head, the embedding and the final norm trained too: the
// last two exist on one pipeline stage each, so their patterns match on one rank only.
using LoraStack = peft::Stack<peft::Lora<4, 8>, peft::Train<"model.embed_tokens", "model.norm">>;

// 6 steps, global batch 8 in microbatches of 2, clipping at 0.5 (tiny_run), 4 decoder layers.
// With `outputs`, the run exports (the merged model and the adapter) and writes its logs.
d9d::TrainerConfig run_config(const std::string& dir, const std::string& mesh = "",
                              bool outputs = false) {
  return tiny_run(dir, 6, 8, 2, outputs, 4, mesh);
}

template <class Peft>
RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx, bool outputs = false) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_plan<d9d::Plan<Peft, Fp64>>(
      local,
      tiny_run(env.scratch_dir() + "/one" + std::to_string(env.rank()), 6, 8, 8, outputs, 4));
}

// The tensors of two safetensors files agree by name (float32 files: the exports' dtype, so the
// bound is float32's rounding of values of size ~1 plus the runs' difference, kParameterAtol).
void expect_same_file(const std::string& got, const std::string& want) {
  const auto got_tensors = d9d::state::load_safetensors(got);
  const auto want_tensors = d9d::state::load_safetensors(want);
  ASSERT_EQ(got_tensors.size(), want_tensors.size()) << got;
  for (std::size_t i = 0; i < want_tensors.size(); ++i) {
    const auto& [name, value] = want_tensors[i];
    ASSERT_EQ(got_tensors[i].first, name) << got;
    ASSERT_EQ(got_tensors[i].second.sizes(), value.sizes()) << name;
    const double diff =
        (got_tensors[i].second.to(at::kDouble) - value.to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, d9d::testing::kParameterAtol + 1e-6 * value.abs().max().item<double>())
        << got << ": " << name;
  }
}

// The exported adapter (peft's format, its config text too) and merged model equal one process's.
void expect_same_exports(const d9d::TrainResult& got, const d9d::TrainResult& want) {
  ASSERT_FALSE(got.adapter_dir.empty());
  expect_same_file(got.adapter_dir + "/adapter_model.safetensors",
                   want.adapter_dir + "/adapter_model.safetensors");
  EXPECT_EQ(d9d::model::read_text_file(got.adapter_dir + "/adapter_config.json"),
            d9d::model::read_text_file(want.adapter_dir + "/adapter_config.json"));
  expect_same_file(got.export_dir + "/model.safetensors", want.export_dir + "/model.safetensors");
}

TEST(Peft_Lora_ws2, FullyShardMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
    const auto want = reference<LoraStack>(env, ctx, /*outputs=*/true);
    const auto got = train_plan<d9d::Plan<ShardMesh, d9d::parallel::Fsdp, LoraStack, Fp64>>(
        ctx, run_config(dir + "/fsdp", "", /*outputs=*/true));
    d9d::testing::expect_same_run(got, want, "LoRA under FullyShard 2");
    // The export gathers the adapters' shards: the same adapter file (and config) and the same
    // merged model as one process writes.
    if (env.rank() == 0) {
      expect_same_exports(got.result, want.result);
    } else {
      EXPECT_TRUE(got.result.adapter_dir.empty()) << "the main rank writes";
    }
    // Only what trains is recorded (and sharded); the frozen base stays whole on each rank.
    EXPECT_EQ(got.parameters.size(), want.parameters.size());
    EXPECT_EQ(got.parameters.size(), 4U * 7U * 2U + 2U);
    // Replicate over 2 ranks as well (the bucketed all-reduce of the adapters' gradients).
    using DpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<DpMesh, peft::Lora<4, 8, "*.q_proj", "*.v_proj">, Fp64>>(
            ctx, run_config(dir + "/replicate")),
        reference<peft::Lora<4, 8, "*.q_proj", "*.v_proj">>(env, ctx), "LoRA under Replicate 2");
  });
}

TEST(Peft_Lora_ws2, PipelineMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = reference<LoraStack>(env, ctx, /*outputs=*/true);
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    const auto got = train_plan<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, LoraStack, Fp64>>(
        ctx, run_config(dir + "/1f1b", R"({"pp": 2})", /*outputs=*/true));
    d9d::testing::expect_same_run(got, want, "LoRA, pp 2, 1F1B");
    // The export: each stage's adapters (and the embedding and the final norm, trained, on
    // different stages) in one peft adapter, and the merged model, as one process writes them.
    if (env.rank() == 0) {
      expect_same_exports(got.result, want.result);
    } else {
      EXPECT_TRUE(got.result.adapter_dir.empty()) << "the main rank writes";
    }
    d9d::testing::expect_same_run(
        train_plan<d9d::Plan<PpMesh, d9d::pipeline::ZeroBubbleH1<>, LoraStack, Fp64>>(
            ctx, run_config(dir + "/zb", R"({"pp": 2})")),
        want, "LoRA, pp 2, ZeroBubbleH1 (the adapters' weight gradients in W actions)");
  });
}

TEST(Peft_Lora_ws2, APatternMatchingOnNoStageFailsEveryRank) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    using Typo = peft::Stack<peft::Lora<4, 8>, peft::Train<"model.embed_token">>;
    try {
      (void)train_plan<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, Typo, Fp64>>(
          ctx, run_config(dir + "/typo", R"({"pp": 2})"));
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(R"(the pattern "model.embed_token")"),
                std::string::npos)
          << error.what();
    }
  });
}

// ---- LoRA under tensor parallelism
// ---------------------------------------------------------------

using Tp = d9d::parallel::TensorParallel<>;
using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;

// Adapters on every projection (column- and row-parallel) and on the untied LM head
// (column-parallel over the vocabulary); the embedding (split by vocabulary) and every norm (the
// per-head q/k norms' gradients are partial over tp) train too.
using TpLoraStack =
    peft::Stack<peft::Lora<4, 8, "*_proj", "lm_head">, peft::Train<"model.embed_tokens", "*norm">>;

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_adapter(const std::string& name) {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

// A record's placement on tp (Replicate when it is not on tp).
d9d::Placement tp_placement(const d9d::parallel::ParameterRecord& record) {
  for (std::size_t i = 0; i < record.dims.size(); ++i) {
    if (record.dims[i] == "tp") {
      return record.placements[i];
    }
  }
  return d9d::Replicate{};
}

// This tp rank's part of a whole tensor laid out as `record` is on tp.
at::Tensor tp_part(const d9d::parallel::ParameterRecord& record, const at::Tensor& whole, int rank,
                   int ranks) {
  const auto placement = tp_placement(record);
  if (!std::holds_alternative<d9d::Shard>(placement)) {
    return whole;
  }
  const int64_t dim = std::get<d9d::Shard>(placement).dim;
  const int64_t part = whole.size(dim) / ranks;
  return whole.narrow(dim, rank * part, part);
}

// One forward and backward of the tiny Qwen3 with TpLoraStack under tp 2 (plain or sequence
// parallel) against one process, with every lora_B non-zero (new adapters start with B = 0, which
// makes A's gradient zero). The split factors' gradients are this rank's slices of the whole
// gradients. The whole factors' are partial sums (the GradientSync that apply_tensor_parallel adds
// sums them over tp after the backward; not called here): A of a column-parallel layer (q/k/v,
// gate/up, lm_head) gets sum_r (B_r^T dy_r) x^T, this rank's output columns only — copy_in makes
// the input's gradient whole, not A's; B of a row-parallel layer (o, down) gets dy (A_r x_r)^T,
// this rank's share of A x only. Summed over tp they equal the whole gradients, alone they do not.
// float64; values of size ~1 through sums of at most ~10^2 terms: n·u ~ 1e-14, bound 1e-12.
void expect_adapter_gradients(const d9d::DistributedContext& ctx, bool sequence_parallel) {
  const auto config =
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2));
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM whole(config);
  whole->to(at::kDouble);
  peft::apply_stack(*whole, peft::stack_spec<TpLoraStack>());
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM split(config);
  const auto mesh = d9d::DeviceMesh(ctx, d9d::MeshShape{.tp = 2});
  const auto parallel =
      sequence_parallel ? d9d::parallel::parallelize<d9d::Plan<TpMesh, TpSp, TpLoraStack, Fp64>>(
                              mesh, {split.ptr()})
                        : d9d::parallel::parallelize<d9d::Plan<TpMesh, Tp, TpLoraStack, Fp64>>(
                              mesh, {split.ptr()});
  const auto tp = mesh.group(d9d::MeshDomain::regular, "tp");
  auto whole_parameters = whole->named_parameters();
  {
    const at::NoGradGuard no_grad;
    auto generator = at::detail::createCPUGenerator(29);
    for (const auto& record : parallel->parameters()) {
      auto& value = whole_parameters[record.name];
      if (ends_with(record.name, ".lora_B.weight")) {
        value.copy_(at::randn(value.sizes(), generator, value.options()) * 0.1);
      }
      at::Tensor(record.local).copy_(tp_part(record, value, tp.rank(), tp.size()));
    }
  }
  auto generator = at::detail::createCPUGenerator(23);
  const auto ids = at::randint(64, {2, 16}, generator, at::kLong);
  const auto labels = at::randint(64, {2, 16}, generator, at::kLong);
  const auto got = split->loss(ids, labels);
  const auto want = whole->loss(ids, labels);
  EXPECT_NEAR(got.loss_sum.item<double>(), want.loss_sum.item<double>(),
              1e-12 * want.loss_sum.item<double>());
  got.loss_sum.backward();
  want.loss_sum.backward();
  int partial_adapters = 0;
  for (const auto& record : parallel->parameters()) {
    const auto& grad = record.local.grad();
    ASSERT_TRUE(grad.defined()) << record.name;
    const auto whole_grad =
        tp_part(record, whole_parameters[record.name].grad(), tp.rank(), tp.size());
    const bool replicated = std::holds_alternative<d9d::Replicate>(tp_placement(record));
    const bool partial = replicated && (is_adapter(record.name) || sequence_parallel ||
                                        ends_with(record.name, "q_norm.weight") ||
                                        ends_with(record.name, "k_norm.weight"));
    if (!partial) {
      EXPECT_TRUE(at::allclose(grad, whole_grad, 0.0, 1e-12))
          << record.name << ": " << (grad - whole_grad).abs().max().item<double>();
      continue;
    }
    const auto summed = d9d::all_reduce(tp, grad.contiguous());
    EXPECT_TRUE(at::allclose(summed, whole_grad, 0.0, 1e-12))
        << record.name << " summed over tp: " << (summed - whole_grad).abs().max().item<double>();
    if (is_adapter(record.name)) {
      ++partial_adapters;
      EXPECT_GT((grad - whole_grad).abs().max().item<double>(),
                1e-6 * whole_grad.abs().max().item<double>())
          << record.name << ": its gradient is already whole on one tp rank";
    }
  }
  // Per decoder layer A of q, k, v, gate, up and B of o, down; and A of lm_head.
  EXPECT_EQ(partial_adapters, 2 * 7 + 1);
}

// Every parameter that does not train, whole (gathered through ParallelModel::layout when tensor
// parallelism split it), by name; collective. A frozen parameter holds no gradient buffer.
std::map<std::string, at::Tensor> frozen_parameters(d9d::detail::TrainerCore& core) {
  std::map<std::string, at::Tensor> out;
  for (const auto& root : core.parallel().modules()) {
    for (const auto& item : root->named_parameters()) {
      if (core.parallel().find(item.key()) != nullptr) {
        continue;
      }
      EXPECT_FALSE(item.value().requires_grad()) << item.key();
      EXPECT_FALSE(item.value().grad().defined()) << item.key() << " holds a gradient";
      const auto* layout = core.parallel().layout(item.key());
      out[item.key()] = layout != nullptr ? layout->sharded(core.mesh()).full_tensor().cpu()
                                          : item.value().detach().cpu();
    }
  }
  return out;
}

struct LoraRun {
  RunOutcome outcome;
  std::map<std::string, at::Tensor> frozen;
};

template <class Plan>
LoraRun train_lora(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config) {
  d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
  LoraRun out;
  out.outcome.result = trainer.train();
  out.outcome.parameters = d9d::testing::full_parameters(trainer.core());
  out.frozen = frozen_parameters(trainer.core());
  return out;
}

LoraRun tp_reference(RankEnv& env, bool outputs = false) {
  const auto ctx = d9d::testing::rank_context(env);
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_lora<d9d::Plan<TpLoraStack, Fp64>>(
      local,
      tiny_run(env.scratch_dir() + "/one_tp" + std::to_string(env.rank()), 6, 8, 8, outputs, 4));
}

// Losses, gradient norms and trained parameters as expect_same_run; the frozen base bit-identical
// to the reference's (it never changes: gathered from its tp shards it is the model the provider
// built). Under a pipeline each rank compares its stage's parameters.
void expect_same_lora_run(const LoraRun& got, const LoraRun& want, const std::string& what) {
  d9d::testing::expect_same_run(got.outcome, want.outcome, what);
  ASSERT_FALSE(got.frozen.empty()) << what;
  for (const auto& [name, value] : got.frozen) {
    const auto found = want.frozen.find(name);
    ASSERT_NE(found, want.frozen.end()) << what << ": " << name;
    EXPECT_TRUE(at::equal(value, found->second)) << what << ": the frozen " << name << " changed";
  }
}

// The adapter factors that stay whole on tp are identical on the tp ranks after training (their
// partial gradients are summed over tp), as is every other replicated parameter.
void expect_replicas_identical(d9d::detail::TrainerCore& core) {
  const auto tp = core.mesh().group(d9d::MeshDomain::regular, "tp");
  int replicated_adapters = 0;
  for (const auto& record : core.parallel().parameters()) {
    if (!std::holds_alternative<d9d::Replicate>(tp_placement(record))) {
      continue;
    }
    replicated_adapters += is_adapter(record.name) ? 1 : 0;
    const auto all = d9d::all_gather(tp, record.local.detach());
    for (const auto& other : all) {
      EXPECT_TRUE(at::equal(other, all[0])) << record.name << " differs over tp";
    }
  }
  EXPECT_EQ(replicated_adapters, 4 * 7 + 1);
}

// The records: adapters split as their layer, with the whole shape; the frozen base weights'
// layout for export.
void expect_lora_records(d9d::detail::TrainerCore& core) {
  const auto& parallel = core.parallel();
  const auto expect = [&](const std::string& name, const std::vector<int64_t>& global,
                          const std::vector<int64_t>& local, bool split) {
    const auto* record = parallel.find(name);
    ASSERT_NE(record, nullptr) << name;
    EXPECT_EQ(record->global_shape, global) << name;
    EXPECT_EQ(record->local.sizes().vec(), local) << name;
    EXPECT_EQ(record->sharded_dims(),
              split ? std::vector<std::string>{"tp"} : std::vector<std::string>{})
        << name;
  };
  const std::string attention = "model.layers.0.self_attn.";
  expect(attention + "q_proj.lora_B.weight", {32, 4}, {16, 4}, true);   // Shard(0)
  expect(attention + "q_proj.lora_A.weight", {4, 32}, {4, 32}, false);  // whole
  expect(attention + "o_proj.lora_A.weight", {4, 32}, {4, 16}, true);   // Shard(1)
  expect(attention + "o_proj.lora_B.weight", {32, 4}, {32, 4}, false);  // whole
  expect("model.layers.1.mlp.down_proj.lora_A.weight", {4, 64}, {4, 32}, true);
  expect("lm_head.lora_B.weight", {64, 4}, {32, 4}, true);
  EXPECT_EQ(parallel.find(attention + "q_proj.weight"), nullptr) << "the frozen base is recorded";
  const auto* base = parallel.layout(attention + "o_proj.weight");
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(base->global_shape, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(base->local.sizes().vec(), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(base->sharded_dims(), std::vector<std::string>{"tp"});
  // Every projection's and the head's weight, split and frozen.
  EXPECT_EQ(parallel.frozen_split_parameters().size(), 4U * 7U + 1U);
}

TEST(Peft_Lora_tp2, MatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    expect_adapter_gradients(ctx, /*sequence_parallel=*/false);
    expect_adapter_gradients(ctx, /*sequence_parallel=*/true);
    const auto want = tp_reference(env, /*outputs=*/true);
    d9d::Trainer<d9d::Plan<TpMesh, Tp, TpLoraStack, Fp64>> trainer(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        run_config(dir + "/tp", R"({"tp": 2})", /*outputs=*/true));
    LoraRun got;
    got.outcome.result = trainer.train();
    got.outcome.parameters = d9d::testing::full_parameters(trainer.core());
    got.frozen = frozen_parameters(trainer.core());
    expect_lora_records(trainer.core());
    expect_replicas_identical(trainer.core());
    expect_same_lora_run(got, want, "LoRA, tp 2");
    EXPECT_EQ(got.frozen.size(), want.frozen.size());
    if (env.rank() == 0) {
      expect_same_exports(got.outcome.result, want.outcome.result);
    }
    // Sequence parallelism: the adapters' whole factors are replicated parameters like the norms,
    // whose gradients are summed over tp there anyway.
    expect_same_lora_run(train_lora<d9d::Plan<TpMesh, TpSp, TpLoraStack, Fp64>>(
                             ctx, run_config(dir + "/sp", R"({"tp": 2})")),
                         want, "LoRA, tp 2 + sequence parallel");
  });
}

TEST(Peft_Lora_ws4, TensorParallelTimesFullyShardAndPipelineMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = tp_reference(env, /*outputs=*/true);
    // FullyShard shards the adapters' tp shards (and whole factors) over dp_shard; the frozen base
    // stays as tensor parallelism split it.
    using TpShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
    const auto sharded =
        train_lora<d9d::Plan<TpShardMesh, Tp, d9d::parallel::Fsdp, TpLoraStack, Fp64>>(
            ctx, run_config(dir + "/fsdp", R"({"dp_shard": 2, "tp": 2})", /*outputs=*/true));
    expect_same_lora_run(sharded, want, "LoRA, tp 2 x FullyShard 2");
    if (env.rank() == 0) {
      expect_same_exports(sharded.outcome.result, want.outcome.result);
    }
    expect_same_lora_run(
        train_lora<d9d::Plan<TpShardMesh, TpSp, d9d::parallel::Fsdp, TpLoraStack, Fp64>>(
            ctx, run_config(dir + "/sp_fsdp", R"({"dp_shard": 2, "tp": 2})")),
        want, "LoRA, tp 2 + sequence parallel x FullyShard 2");
    // tp 2 x pp 2: ZeroBubbleH1's W actions compute the split adapters' weight gradients; the
    // export gathers each stage's tp shards and sends them to the main rank.
    using TpPpMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::tp<d9d::dynamic>>;
    const auto piped =
        train_lora<d9d::Plan<TpPpMesh, Tp, d9d::pipeline::ZeroBubbleH1<>, TpLoraStack, Fp64>>(
            ctx, run_config(dir + "/zb", R"({"pp": 2, "tp": 2})", /*outputs=*/true));
    expect_same_lora_run(piped, want, "LoRA, tp 2 x pp 2, ZeroBubbleH1");
    if (env.rank() == 0) {
      expect_same_exports(piped.outcome.result, want.outcome.result);
    }
  });
}

// A training checkpoint of LoRA under tp 2 (the adapters' records, Shard on tp or whole) saved
// after 2 of 4 steps, resumed in one process and saved there, resumed under tp 2 again and run to
// the end: steps 2 and 3 and the final adapters are bit-identical to the uninterrupted run
// (float32: every piece is copied as stored).
TEST(Peft_Lora_tp2, CheckpointResumesInOneProcessAndBack) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string& root = env.scratch_dir();
    const auto config = [&](const std::string& out, const std::string& mesh,
                            const std::string& checkpoints, const std::string& resume) {
      auto cfg = tiny_run(root + "/" + out + std::to_string(env.rank()), 4, 8, 2, false, 4, mesh);
      cfg.checkpoint.dir = root + "/" + checkpoints;
      cfg.checkpoint.every = 2;
      cfg.checkpoint.keep = 4;
      cfg.checkpoint.async = false;
      cfg.checkpoint.resume_from = resume;
      return cfg;
    };
    using TpPlan = d9d::Plan<TpMesh, Tp, TpLoraStack>;
    d9d::Trainer<TpPlan> straight(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                  d9d::CausalLmTask{}, config("b", R"({"tp": 2})", "B", ""));
    const auto want = straight.train();
    const auto want_parameters = d9d::testing::full_parameters(straight.core());
    if (env.rank() == 0) {
      const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
      d9d::Trainer<d9d::Plan<TpLoraStack>> one(
          local, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          config("a", "", "A", root + "/B/step-2"));
      EXPECT_EQ(one.core().save_checkpoint(), root + "/A/step-2");
    }
    ctx.barrier();
    d9d::Trainer<TpPlan> resumed(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                 d9d::CausalLmTask{},
                                 config("c", R"({"tp": 2})", "C", root + "/A/step-2"));
    const auto got = resumed.train();
    d9d::testing::expect_resumed_run(got, d9d::testing::full_parameters(resumed.core()), want,
                                     want_parameters, 2);
    ctx.barrier();
  });
}

}  // namespace
