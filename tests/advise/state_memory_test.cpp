// d9d::advise's state prediction (d9d/advise/state_memory.hpp) against what Trainer<Plan> holds:
// every rank's parameter, gradient and AdamW-moment bytes, exactly, after three steps of the tiny
// Qwen3, under Replicate (2 Gloo ranks), FullyShard (3 ranks, so rows split unevenly) in four
// precisions, tensor parallelism (alone, with sequence parallelism, x FullyShard on 4 ranks) and
// pipelines (1F1B, ZBV with a tied head, 1F1B x FullyShard on 4 ranks), and a Qwen3-MoE under
// expert parallelism (ep 2, x FullyShard 2 and 4) and FullyShard alone, and PEFT policies (LoRA,
// a LoRA + Train stack, Freeze) under Replicate and a pipeline; the parameter lists against the
// model's and the stages' own, and under peft stacks against the model d9d::peft::apply_stack
// adapted; torch.chunk's row rule; expert parallelism's rules; and the Plans not predicted yet are
// refused by name.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/advise/compare.hpp>
#include <d9d/advise/state_memory.hpp>
#include <d9d/d9d.hpp>
#include <d9d/peft/lora.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::advise::StateBytes;
using d9d::testing::RankEnv;
using ::testing::HasSubstr;

TEST(Advise_StateMemory, Qwen3ParametersAreTheModelsOwnInOrder) {
  for (const bool tied : {false, true}) {
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(tied, 3));
    const d9d::model::Qwen3ForCausalLM model(config);
    const auto predicted = d9d::advise::qwen3_parameters(config);
    const auto actual = model->named_parameters();
    ASSERT_EQ(predicted.size(), actual.size()) << (tied ? "tied" : "untied");
    for (std::size_t i = 0; i < predicted.size(); ++i) {
      EXPECT_EQ(predicted[i].name, actual[i].key());
      EXPECT_EQ(at::IntArrayRef(predicted[i].sizes), actual[i].value().sizes()) << actual[i].key();
      EXPECT_EQ(predicted[i].numel(), actual[i].value().numel()) << actual[i].key();
    }
  }
}

TEST(Advise_StateMemory, Qwen3StageParametersAreTheStagesOwn) {
  for (const bool tied : {false, true}) {
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(tied, 4));
    for (int stages = 1; stages <= 4; ++stages) {
      const auto ranges =
          d9d::model::distribute_layers(4, stages, d9d::model::pipeline_virtual_layers(config, 16));
      for (int s = 0; s < stages; ++s) {
        const d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
        const auto predicted = d9d::advise::qwen3_stage_parameters(config, s, stages, 16);
        const auto actual = stage->named_parameters();
        const auto what = std::string(tied ? "tied" : "untied") + ", stage " + std::to_string(s) +
                          " of " + std::to_string(stages);
        ASSERT_EQ(predicted.size(), actual.size()) << what;
        for (std::size_t i = 0; i < predicted.size(); ++i) {
          EXPECT_EQ(predicted[i].name, actual[i].key()) << what;
          EXPECT_EQ(at::IntArrayRef(predicted[i].sizes), actual[i].value().sizes()) << what;
        }
      }
    }
  }
  EXPECT_THAT(d9d::testing::error_of([] {
                (void)d9d::advise::qwen3_stage_parameters(d9d::model::Qwen3Config{}, 2, 2, 16);
              }),
              HasSubstr("stage 2 is not one of 2 stages"));
}

TEST(Advise_StateMemory, ShardRowsFollowTorchChunk) {
  for (const int64_t rows : {0, 1, 2, 7, 8, 64}) {
    for (const int ranks : {1, 2, 3, 4}) {
      const auto chunks = at::empty({rows}).chunk(ranks);
      int64_t total = 0;
      for (int r = 0; r < ranks; ++r) {
        const int64_t want =
            r < static_cast<int>(chunks.size()) ? chunks[static_cast<std::size_t>(r)].size(0) : 0;
        EXPECT_EQ(d9d::advise::shard_rows(rows, ranks, r), want)
            << rows << " rows, rank " << r << " of " << ranks;
        total += d9d::advise::shard_rows(rows, ranks, r);
      }
      EXPECT_EQ(total, rows);
    }
  }
  EXPECT_THAT(d9d::testing::error_of([] { (void)d9d::advise::shard_rows(8, 2, 2); }),
              HasSubstr("rank 2 of 2 ranks"));
  EXPECT_THAT(
      d9d::testing::error_of([] { (void)d9d::advise::state_bytes({}, {.shard_ranks = 2}, 3); }),
      HasSubstr("shard rank 3 outside a group of 2"));
  // A tensor-parallel split that does not divide is named.
  const std::vector<d9d::advise::ParameterShape> odd{
      {.name = "w", .sizes = {3, 4}, .tensor_split_dim = 0}};
  EXPECT_THAT(
      d9d::testing::error_of([&] { (void)d9d::advise::state_bytes(odd, {.tensor_ranks = 2}, 0); }),
      HasSubstr("w's dimension 0 (3) does not split over 2 tensor ranks"));
}

TEST(Advise_StateMemory, PlansNotPredictedYetAreRefusedByName) {
  using Lora = d9d::peft::Lora<8, 16>;
  EXPECT_NO_THROW((void)d9d::advise::state_rules<d9d::Plan<Lora>>(d9d::MeshShape{}));  // Replicate
  EXPECT_THAT(
      d9d::testing::error_of([&] {
        (void)d9d::advise::state_rules<
            d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>, Lora>>(
            d9d::MeshShape{.dp_shard = 2});
      }),
      HasSubstr("a PEFT policy under FullyShard (the frozen parameters' shards) is not "
                "predicted yet"));
  EXPECT_THAT(
      d9d::testing::error_of([&] {
        (void)d9d::advise::state_rules<
            d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>, d9d::parallel::TensorParallel<>, Lora>>(
            d9d::MeshShape{.tp = 2});
      }),
      HasSubstr("a PEFT policy under tensor or expert parallelism"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::advise::qwen3_rank_parameters<d9d::Plan<Lora>>(
                    d9d::model::Qwen3MoeConfig::from_json_text(d9d::testing::tiny_qwen3_moe_json()),
                    d9d::MeshShape{}, 0, 1, 16);
              }),
              HasSubstr("a PEFT policy on a Qwen3-MoE is not predicted yet"));
}

// apply_peft against the model d9d::peft::apply_stack adapts: every parameter's name, order,
// shape and whether it trains, for LoRA on every linear layer, LoRA on named layers with the head,
// a LoRA + Train stack, and Freeze.
TEST(Advise_StateMemory, PeftParametersAreTheAdaptedModelsOwn) {
  const auto check = [](const d9d::peft::StackSpec& spec) {
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, 2));
    d9d::model::Qwen3ForCausalLM model(config);
    d9d::peft::apply_stack(*model, spec);
    const auto predicted = d9d::advise::apply_peft(d9d::advise::qwen3_parameters(config), spec);
    const auto actual = model->named_parameters();
    const auto what = spec.methods.front().describe();
    ASSERT_EQ(predicted.size(), actual.size()) << what;
    for (std::size_t i = 0; i < predicted.size(); ++i) {
      EXPECT_EQ(predicted[i].name, actual[i].key()) << what;
      EXPECT_EQ(at::IntArrayRef(predicted[i].sizes), actual[i].value().sizes())
          << what << ": " << actual[i].key();
      EXPECT_EQ(predicted[i].trained, actual[i].value().requires_grad())
          << what << ": " << actual[i].key();
    }
  };
  check(d9d::peft::stack_spec<d9d::peft::Lora<4, 8>>());
  check(d9d::peft::stack_spec<d9d::peft::Lora<2, 4, "*.q_proj", "down_proj", "lm_head">>());
  check(d9d::peft::stack_spec<
        d9d::peft::Stack<d9d::peft::Lora<3, 6, "*.v_proj">, d9d::peft::Train<"*norm">>>());
  check(d9d::peft::stack_spec<d9d::peft::Freeze<"model.embed_tokens", "model.layers.0">>());
}

// Expert parallelism's rules: the experts over ep_shard and, under FullyShard, over the expert
// domain's ep_replicate (d9d::DeviceMesh's rule; HSDP replicas stay outside it when the expert
// groups fit in one).
TEST(Advise_StateMemory, ExpertParallelRulesFollowTheExpertDomain) {
  using ShardEp = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>,
                            d9d::parallel::ExpertParallel<>, d9d::parallel::FullyShard<>>;
  const auto sharded = d9d::advise::state_rules<ShardEp>(d9d::MeshShape{.dp_shard = 8, .ep = 2});
  EXPECT_TRUE(sharded.expert_parallel);
  EXPECT_EQ(sharded.shard_ranks, 8);
  EXPECT_EQ(sharded.expert_ranks, 2);
  EXPECT_EQ(sharded.expert_shard_ranks, 4);
  EXPECT_EQ(
      d9d::advise::state_rules<ShardEp>(d9d::MeshShape{.dp_shard = 2, .ep = 2}).expert_shard_ranks,
      1);
  EXPECT_EQ(d9d::advise::expert_replicate_ranks(
                d9d::MeshShape{.dp_replicate = 2, .dp_shard = 4, .ep = 4}),
            1);
  EXPECT_EQ(d9d::advise::expert_replicate_ranks(
                d9d::MeshShape{.dp_replicate = 2, .dp_shard = 2, .ep = 4}),
            1);
  using ReplicateEp = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>,
                                d9d::parallel::ExpertParallel<>>;
  const auto whole =
      d9d::advise::state_rules<ReplicateEp>(d9d::MeshShape{.dp_replicate = 4, .ep = 2});
  EXPECT_EQ(whole.expert_ranks, 2);
  EXPECT_EQ(whole.expert_shard_ranks, 1);
  EXPECT_EQ(whole.shard_ranks, 1);
  // Experts that do not split over ep are refused by name.
  auto config = d9d::model::Qwen3MoeConfig::from_json_text(d9d::testing::tiny_qwen3_moe_json());
  config.num_experts = 3;
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::advise::state_bytes(d9d::advise::qwen3_parameters(config), whole, 0);
              }),
              HasSubstr("experts do not split over 2 expert ranks"));
}

// A Qwen3-MoE's parameters are the model's own, in order, with the experts marked (layer 2 dense).
TEST(Advise_StateMemory, Qwen3MoeParametersAreTheModelsOwnInOrder) {
  auto config = d9d::model::Qwen3MoeConfig::from_json_text(d9d::testing::tiny_qwen3_moe_json());
  for (const int64_t shared : {0, 24}) {
    config.shared_expert_intermediate_size = shared;
    d9d::model::Qwen3MoeForCausalLM model(config);
    const auto predicted = d9d::advise::qwen3_parameters(config);
    const auto actual = model->named_parameters();
    ASSERT_EQ(predicted.size(), actual.size()) << "shared expert " << shared;
    int experts = 0;
    for (std::size_t k = 0; k < predicted.size(); ++k) {
      EXPECT_EQ(predicted[k].name, actual[k].key());
      EXPECT_EQ(predicted[k].sizes, actual[k].value().sizes().vec()) << predicted[k].name;
      EXPECT_EQ(predicted[k].expert, predicted[k].name.find(".mlp.experts.") != std::string::npos);
      experts += predicted[k].expert ? 1 : 0;
    }
    EXPECT_EQ(experts, 3 * 3);  // three MoE layers of four
  }
}

// Three steps of `Plan`, then this rank's held bytes against the prediction for its shard rank.
template <class Plan, class Provider = d9d::Qwen3Provider,
          class ModelConfig = d9d::model::Qwen3Config>
void expect_predicted(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config,
                      const std::string& what) {
  d9d::Trainer<Plan> trainer(ctx, Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
  int64_t gradients = -1;  // at the optimizer, when every gradient is there
  trainer.template on<d9d::events::BeforeOptimizer>([&](const d9d::events::BeforeOptimizer&) {
    gradients = 0;
    for (const auto& record : trainer.core().parallel().parameters()) {
      const auto& g = record.local.grad();
      gradients += g.defined() ? static_cast<int64_t>(g.nbytes()) : 0;
    }
  });
  (void)trainer.train();
  StateBytes held;
  held.gradients = gradients;
  for (const auto& record : trainer.core().parallel().parameters()) {
    held.parameters += static_cast<int64_t>(record.local.nbytes());
  }
  held.optimizer = d9d::testing::optimizer_state_bytes(trainer.core().optimizer());
  held.parameters += d9d::bench::detail::frozen_parameter_bytes(trainer.core());

  const auto& mesh = trainer.core().mesh();
  const auto& shape = mesh.shape();
  const auto microbatches =
      static_cast<int>(config.batch.global_batch_size /
                       (config.batch.microbatch_size * shape.dp_replicate * shape.dp_shard));
  const auto parameters = d9d::advise::qwen3_rank_parameters<Plan>(
      ModelConfig::from_json_text(config.sections.at("model")), shape,
      mesh.coordinate(d9d::MeshDomain::regular, "pp"), microbatches, config.batch.sequence_length);
  ASSERT_EQ(trainer.core().parallel().parameters().size(),
            std::count_if(parameters.begin(), parameters.end(),
                          [](const d9d::advise::ParameterShape& p) { return p.trained; }))
      << what;
  const auto rules = d9d::advise::state_rules<Plan>(shape);
  const int shard_rank =
      rules.shard_ranks > 1 ? mesh.coordinate(d9d::MeshDomain::dense, "dp_cp_shard") : 0;
  const int expert_shard_rank =
      rules.expert_shard_ranks > 1 ? mesh.coordinate(d9d::MeshDomain::expert, "ep_replicate") : 0;
  const auto predicted = d9d::advise::state_bytes(parameters, rules, shard_rank, expert_shard_rank);
  const auto rank = " (rank " + std::to_string(ctx.rank()) + ")";
  EXPECT_GT(held.parameters, 0) << what << rank;
  EXPECT_EQ(predicted.parameters, held.parameters) << what << rank;
  EXPECT_EQ(predicted.gradients, held.gradients) << what << rank;
  EXPECT_EQ(predicted.optimizer, held.optimizer) << what << rank;
  EXPECT_EQ(predicted.total(), held.parameters + held.gradients + held.optimizer) << what << rank;
  // FullyShard without a pipeline: the units gathered at once at the step's peak (the config's
  // reshard, "after_forward" unless set).
  // (Not under Float8: its float8 gather's units are not predicted yet.)
  if (rules.shard_ranks > 1 && shape.pp == 1 && rules.expert_shard_ranks == 1 &&
      !d9d::precision::has_float8<typename Plan::precision>) {
    const bool reshard = config.data_parallel.reshard != "never";
    const auto gathered = d9d::advise::fully_shard_gathered_bytes(
        parameters, rules, d9d::precision::scalar_type(Plan::precision::compute), reshard);
    EXPECT_EQ(gathered.units, trainer.core().parallel().peak_extra_bytes())
        << what << rank << ", reshard " << config.data_parallel.reshard;
  }
}

using ReplicateMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;

TEST(Advise_StateMemory_ws2, ReplicateEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/r", 3, 4, 2);
    expect_predicted<d9d::Plan<ReplicateMesh>>(ctx, config, "Replicate, Fp32");
    expect_predicted<d9d::Plan<ReplicateMesh, d9d::precision::Bf16Mixed>>(ctx, config,
                                                                          "Replicate, Bf16Mixed");
  });
}

// Float8 keeps its base policy's state (the float8 copies live during the step): Replicate with
// per-tensor scales, FullyShard with the float8 weight gather in both reshard modes.
TEST(Advise_StateMemory_ws2, Float8KeepsItsBasePolicysState) {
  using d9d::precision::Float8;
  using d9d::precision::Scaling;
  using d9d::precision::WeightGather;
  EXPECT_EQ(d9d::advise::state_rules<d9d::Plan<Float8<>>>(d9d::MeshShape{}).parameters,
            at::kFloat);  // over Bf16Mixed: float32 master weights
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/f8", 3, 4, 2);
    expect_predicted<
        d9d::Plan<ReplicateMesh,
                  Float8<Scaling::tensorwise, WeightGather::compute_dtype, d9d::precision::Fp32>>>(
        ctx, config, "Replicate, Float8 tensorwise over Fp32");
    using Gathered = Float8<Scaling::rowwise, WeightGather::float8, d9d::precision::Fp32>;
    expect_predicted<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Gathered>>(
        ctx, config, "FullyShard, Float8 rowwise with the float8 gather over Fp32");
    auto kept = config;
    kept.data_parallel.reshard = "never";
    expect_predicted<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Gathered>>(
        ctx, kept, "FullyShard, Float8 with the float8 gather, reshard never");
  });
}

// Three ranks: the vocabulary's 64 rows split 22, 22, 20 and the 8-row norms 3, 3, 2.
TEST(Advise_StateMemory_ws3, FullyShardEqualsWhatTheTrainerHoldsOnUnevenRows) {
  d9d::testing::run_on_ranks({.world_size = 3}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/s", 3, 6, 2);
    using Fsdp = d9d::parallel::FullyShard<>;
    expect_predicted<d9d::Plan<ShardMesh, Fsdp>>(ctx, config, "FullyShard, Fp32");
    expect_predicted<d9d::Plan<ShardMesh, Fsdp, d9d::precision::Bf16Params<>>>(
        ctx, config, "FullyShard, Bf16Params (float32 moments)");
    expect_predicted<
        d9d::Plan<ShardMesh, Fsdp, d9d::precision::Bf16Params<d9d::precision::NearestRounding>>>(
        ctx, config, "FullyShard, Bf16Params<NearestRounding> (bfloat16 moments)");
    auto kept = config;  // every unit stays gathered
    kept.data_parallel.reshard = "never";
    expect_predicted<d9d::Plan<ShardMesh, Fsdp, d9d::precision::Bf16Mixed>>(
        ctx, kept, "FullyShard, Bf16Mixed");
  });
}

// Pipelines: each rank holds its stages' parameters. 1F1B on 2 ranks (4 layers split by the
// stages' FLOPs); ZBV's V placement with a tied head (rank 0 holds stage 0's embedding and the last
// stage's copy of it); and 1F1B x FullyShard 2 on 4 ranks in Bf16Mixed.
TEST(Advise_StateMemory_ws2, PipelineStagesEqualWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/p", 3, 4, 2, false, 4);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>>>(
        ctx, config, "1F1B pp 2, Fp32");
    auto tied = config;
    tied.sections["model"] = d9d::testing::tiny_qwen3_json(true, 4);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::ZeroBubbleV<>>>(
        ctx, tied, "ZBV pp 2, tied head, Fp32");
  });
}

// PEFT policies: LoRA on every linear layer (float32, and bfloat16 parameters rounding
// stochastically), a LoRA + Train stack under Bf16Mixed, Freeze, and LoRA under 1F1B pp 2.
TEST(Advise_StateMemory_ws2, PeftPlansEqualWhatTheTrainerHolds) {
  using Lora = d9d::peft::Lora<4, 8>;
  using Stacked = d9d::peft::Stack<d9d::peft::Lora<2, 4, "*.q_proj">, d9d::peft::Train<"*norm">>;
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/lora", 3, 4, 2, false, 4);
    expect_predicted<d9d::Plan<ReplicateMesh, Lora>>(ctx, config, "Replicate, LoRA, Fp32");
    expect_predicted<d9d::Plan<ReplicateMesh, Lora, d9d::precision::Bf16Params<>>>(
        ctx, config, "Replicate, LoRA, Bf16Params");
    expect_predicted<d9d::Plan<ReplicateMesh, Stacked, d9d::precision::Bf16Mixed>>(
        ctx, config, "Replicate, LoRA on q + Train norms, Bf16Mixed");
    expect_predicted<d9d::Plan<ReplicateMesh, d9d::peft::Freeze<"model.embed_tokens">>>(
        ctx, config, "Replicate, Freeze the embedding");
    expect_predicted<d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>, Lora>>(
        ctx, config, "1F1B pp 2, LoRA, Fp32");
  });
}

TEST(Advise_StateMemory_ws4, PipelineTimesFullyShardEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/pf", 3, 8, 2, false, 4);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::pp<2>, d9d::dp_shard<2>>, d9d::parallel::FullyShard<>,
                               d9d::pipeline::OneFOneB<>, d9d::precision::Bf16Mixed>>(
        ctx, config, "1F1B pp 2 x FullyShard 2, Bf16Mixed");
  });
}

// Tensor parallelism (Megatron's layout: q/k/v, gate/up, embedding and head by rows, o and down
// by columns, norms whole) on 2 ranks, with sequence parallelism, and under FullyShard 2 (4 ranks),
// which shards the tensor-parallel pieces' rows.
TEST(Advise_StateMemory_ws2, TensorParallelEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/t", 3, 4, 2);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::tp<2>>, d9d::parallel::TensorParallel<>>>(
        ctx, config, "tp 2, Fp32");
    expect_predicted<d9d::Plan<d9d::mesh<d9d::tp<2>>,
                               d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>,
                               d9d::precision::Bf16Mixed>>(ctx, config,
                                                           "tp 2 with sequence parallelism");
  });
}

TEST(Advise_StateMemory_ws4, TensorParallelTimesFullyShardEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/tf", 3, 4, 2);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::dp_shard<2>, d9d::tp<2>>, d9d::parallel::FullyShard<>,
                               d9d::parallel::TensorParallel<>, d9d::precision::Bf16Params<>>>(
        ctx, config, "tp 2 x FullyShard 2, Bf16Params");
  });
}

// Context parallelism splits no parameter: whole under Replicate (cp 2 on 2 ranks), FullyShard's
// rows over dp_shard x cp_shard (2 x 2 on 4 ranks: 16 of the vocabulary's 64 rows per rank, 2 of
// the q/k norms' 8).
TEST(Advise_StateMemory_ws4, ContextParallelEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/c", 3, 4, 2);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::dp_shard<2>, d9d::cp_shard<2>>,
                               d9d::parallel::FullyShard<>, d9d::parallel::ContextParallel<>>>(
        ctx, config, "cp 2 x FullyShard 2, Fp32");
  });
}

TEST(Advise_StateMemory_ws2, ContextParallelEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/c2", 3, 2, 2);
    expect_predicted<d9d::Plan<d9d::mesh<d9d::cp_shard<2>>, d9d::parallel::ContextParallel<>>>(
        ctx, config, "cp 2, Replicate, Fp32");
  });
}

}  // namespace

namespace {

d9d::TrainerConfig moe_run(const std::string& dir, int64_t global_batch, const std::string& mesh) {
  auto config = d9d::testing::tiny_run(dir, 3, global_batch, 2, false, 4, mesh);
  config.sections["model"] = d9d::testing::tiny_qwen3_moe_json();
  return config;
}

template <class Plan>
void expect_moe_predicted(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config,
                          const std::string& what) {
  expect_predicted<Plan, d9d::Qwen3MoeProvider, d9d::model::Qwen3MoeConfig>(ctx, config, what);
}

using EpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
using ShardEpMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
using Ep = d9d::parallel::ExpertParallel<>;

// The tiny Qwen3-MoE (4 experts, layer 2 dense): ep 2 (each rank 2 experts of every MoE layer),
// ep 2 x FullyShard 2 (the rest's rows sharded, the experts whole per ep rank), and FullyShard
// without expert parallelism over 3 ranks (the experts' 4 rows split 2, 2, 0).
TEST(Advise_StateMemory_ws2, ExpertParallelEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/e";
    expect_moe_predicted<d9d::Plan<EpMesh, Ep>>(ctx, moe_run(dir + "1", 4, R"({"ep": 2})"),
                                                "ep 2, Fp32");
    expect_moe_predicted<
        d9d::Plan<ShardEpMesh, Ep, d9d::parallel::FullyShard<>, d9d::precision::Bf16Params<>>>(
        ctx, moe_run(dir + "2", 4, R"({"ep": 2})"), "ep 2 x FullyShard 2, Bf16Params");
  });
}

// 4 ranks, FullyShard 4 x ep 2: ep_replicate 2, so the experts' rows (2 per ep rank) are sharded
// over it too, one each.
TEST(Advise_StateMemory_ws4, ExpertParallelTimesFullyShardShardsTheExperts) {
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    expect_moe_predicted<d9d::Plan<ShardEpMesh, Ep, d9d::parallel::FullyShard<>>>(
        ctx, moe_run(env.scratch_dir() + "/e4", 8, R"({"ep": 2})"), "ep 2 x FullyShard 4, Fp32");
  });
}

TEST(Advise_StateMemory_ws3, MoeUnderFullyShardEqualsWhatTheTrainerHolds) {
  d9d::testing::run_on_ranks({.world_size = 3}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    expect_moe_predicted<d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>>>(
        ctx, moe_run(env.scratch_dir() + "/m3", 6, ""), "MoE, FullyShard 3, Fp32");
  });
}

}  // namespace
