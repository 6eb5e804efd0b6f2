// d9d::advise::preflight<Plan> (d9d/advise/preflight.hpp): the config's "advise" section turns it
// on and is checked key by key; its figures are the advisor's own for the Plan's slots (the state
// under Replicate and FullyShard, the activations without and with a pipeline, the step time from
// the profile named), it warns first when the prediction exceeds memory_gib, and it says what it
// does not predict (LoRA, tensor parallelism's activations under a pipeline) instead of guessing;
// a Qwen3-MoE under expert parallelism gets the MoE advisor's figures.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/advise/preflight.hpp>
#include <d9d/advise/ranking.hpp>
#include <d9d/d9d.hpp>
#include <d9d/peft/lora.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr const char* kModel = R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false})";

// A tiny Qwen3-MoE: 4 experts, top 2, layer 2 dense.
constexpr const char* kMoeModel = R"({"model_type": "qwen3_moe", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": false, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "norm_topk_prob": true, "mlp_only_layers": [2]})";

// The test config for `model_json` (the dense model by default) with an "advise" section (none
// when empty) and, when given, a "data_parallel" section.
d9d::TrainerConfig config_with(const std::string& advise, const std::string& data_parallel = "",
                               const char* model_json = kModel) {
  return d9d::TrainerConfig::from_json_text(
      std::string(R"({"run": {"output_dir": "unused", "total_steps": 1},
          "batch": {"global_batch_size": 8, "microbatch_size": 2, "sequence_length": 16},
          "model": )") +
      model_json + (advise.empty() ? "" : R"(, "advise": )" + advise) +
      (data_parallel.empty() ? "" : R"(, "data_parallel": )" + data_parallel) + "}");
}

d9d::model::Qwen3Config model() { return d9d::model::Qwen3Config::from_json_text(kModel); }

// A profile whose matmuls run at 100 TFLOP/s, with collectives measured on two ranks and the tiny
// MoE's grouped experts (2 per rank).
std::string write_profile() {
  const std::string path = ::testing::TempDir() + "/preflight_profile.json";
  std::ofstream(path) << R"({"device": "Test GPU", "ranks": 2,
      "gemm": [{"m": 1024, "n": 1024, "k": 1024, "layout": "nt", "seconds": 2.147483648e-5},
               {"m": 1024, "n": 1024, "k": 1024, "layout": "nn", "seconds": 2.147483648e-5},
               {"m": 1024, "n": 1024, "k": 1024, "layout": "tn", "seconds": 2.147483648e-5}],
      "attention": [{"batch": 1, "sequence": 16, "heads": 4, "kv_heads": 2, "head_dim": 8,
                     "forward_seconds": 1e-5, "backward_seconds": 2.5e-5}],
      "grouped_experts": [{"groups": 2, "rows": 64, "hidden": 32, "intermediate": 16,
                           "forward_seconds": 1e-5, "backward_seconds": 3e-5}],
      "memory_bytes_per_second": 1e12,
      "collectives": {"all_reduce": [[1024, 1e-5], [1073741824, 1e-2]],
                      "all_gather": [[1024, 1e-5], [1073741824, 1e-2]],
                      "reduce_scatter": [[1024, 1e-5], [1073741824, 1e-2]],
                      "all_to_all": [[1024, 1e-5], [1073741824, 1e-2]],
                      "p2p": [[1024, 1e-5], [1073741824, 1e-2]]}})";
  return path;
}

TEST(Advise_Preflight, TheAdviseSectionTurnsItOnAndIsChecked) {
  EXPECT_FALSE(d9d::advise::preflight_settings(config_with("")).enabled);
  EXPECT_FALSE(d9d::advise::preflight<d9d::Plan<>>(config_with(""), {}).has_value());
  EXPECT_FALSE(
      d9d::advise::preflight<d9d::Plan<>>(config_with(R"({"enabled": false})"), {}).has_value());
  const auto s =
      d9d::advise::preflight_settings(config_with(R"({"memory_gib": 80, "profile": "p.json"})"));
  EXPECT_TRUE(s.enabled);
  EXPECT_DOUBLE_EQ(s.memory_gib, 80);
  EXPECT_EQ(s.profile, "p.json");
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)d9d::advise::preflight_settings(config_with(R"({"memory": 80})")); }),
              HasSubstr("advise.memory: unknown key (advise takes enabled, memory_gib, profile)"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([] {
                (void)d9d::advise::preflight_settings(config_with(R"({"memory_gib": -1})"));
              }),
              HasSubstr("advise.memory_gib: expected a number of GiB >= 0, got -1"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([] {
                (void)d9d::advise::preflight_settings(config_with(R"({"enabled": "yes"})"));
              }),
              HasSubstr("advise.enabled: expected true or false"));
}

TEST(Advise_Preflight, FiguresAreTheAdvisorsForThePlansSlots) {
  // Replicate, float32: the whole model's state and one microbatch's activations.
  const auto config = config_with("{}");
  const auto rep = d9d::advise::preflight<d9d::Plan<>>(config, {});
  ASSERT_TRUE(rep.has_value());
  const auto whole = d9d::advise::qwen3_parameters(model());
  EXPECT_EQ(rep->state_bytes,
            d9d::advise::state_bytes(whole, d9d::advise::precision_rules("fp32"), 0).total());
  ASSERT_TRUE(rep->activation_bytes.has_value());
  EXPECT_EQ(*rep->activation_bytes, d9d::advise::qwen3_activation_bytes(model(), 2, 16).total());
  EXPECT_TRUE(rep->fits);
  EXPECT_FALSE(rep->time.has_value());
  ASSERT_EQ(rep->lines.size(), 1U);
  EXPECT_THAT(rep->lines[0], HasSubstr("advise: replicate (one rank), 4 microbatches; predicted"));

  // FullyShard over 2 in Bf16Mixed: shard 0's state, bfloat16 gathered copies' activations.
  using Fsdp = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>,
                         d9d::precision::Bf16Mixed>;
  const auto fs = d9d::advise::preflight<Fsdp>(config, d9d::MeshShape{.dp_shard = 2});
  ASSERT_TRUE(fs.has_value());
  auto rules = d9d::advise::precision_rules("bf16_mixed");
  rules.shard_ranks = 2;
  EXPECT_EQ(fs->state_bytes, d9d::advise::state_bytes(whole, rules, 0).total());
  EXPECT_EQ(*fs->activation_bytes, d9d::advise::qwen3_activation_bytes(
                                       model(), 2, 16, d9d::advise::Compute::bf16_parameters)
                                       .total());
  EXPECT_THAT(fs->plan, HasSubstr("fully_shard dp_shard 2, 2 microbatches"));

  // 1F1B over 2 stages: the fullest rank's state and its microbatches in flight.
  using Piped = d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>>;
  const auto pp = d9d::advise::preflight<Piped>(config, d9d::MeshShape{.pp = 2});
  ASSERT_TRUE(pp.has_value());
  const auto program = d9d::pipeline::OneFOneB<>::build(2, 4);
  const std::vector<int64_t> per_stage{
      d9d::advise::qwen3_stage_activation_bytes(model(), 0, 2, 2, 16).total(),
      d9d::advise::qwen3_stage_activation_bytes(model(), 1, 2, 2, 16).total()};
  int64_t most = 0;
  for (int r = 0; r < 2; ++r) {
    const auto mine = d9d::advise::qwen3_rank_parameters(model(), program, r, 16);
    most = std::max(
        most, d9d::advise::state_bytes(mine, d9d::advise::precision_rules("fp32"), 0).total() +
                  d9d::advise::peak_rank_activation_bytes(program, r, per_stage));
  }
  EXPECT_EQ(pp->state_bytes + *pp->activation_bytes, most);
}

TEST(Advise_Preflight, TheCopyEnginesBufferHoldsTheGradientsOrAddsBfloat16Sums) {
  // data_parallel.reduce_engine "copy": Replicate's buckets in a buffer every rank maps. In the
  // gradients' dtype the gradients live there (design note 0031): the peak is the all-reduce's,
  // and the line says where they are. Under a bfloat16 reduction of float32 gradients the buffer
  // holds bfloat16 sums beside them: half the gradients' bytes on top. Not under FullyShard, nor
  // on one rank.
  const auto with_engine = [](const std::string& engine) {
    return config_with("{}", R"({"reduce_engine": ")" + engine + R"("})");
  };
  using Rep = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Bf16Mixed>;
  using RepBf16 =
      d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Bf16MixedBf16Reduce>;
  const d9d::MeshShape two{.dp_replicate = 2};
  const auto gradients = d9d::advise::state_bytes(d9d::advise::qwen3_parameters(model()),
                                                  d9d::advise::precision_rules("bf16_mixed"), 0)
                             .gradients;
  const auto backend = d9d::advise::preflight<Rep>(with_engine("backend"), two);
  const auto copy = d9d::advise::preflight<Rep>(with_engine("copy"), two);
  ASSERT_TRUE(backend && copy && backend->peak_bytes && copy->peak_bytes);
  EXPECT_EQ(*copy->peak_bytes, *backend->peak_bytes);  // float32 sums: the gradients' memory
  EXPECT_EQ(copy->state_bytes, backend->state_bytes);
  EXPECT_THAT(copy->lines.at(0), HasSubstr(", the gradients in the copy engine's buffer"));
  EXPECT_THAT(backend->lines.at(0), Not(HasSubstr("copy engine")));
  const auto bf16 = d9d::advise::preflight<RepBf16>(with_engine("copy"), two);
  const auto bf16_backend = d9d::advise::preflight<RepBf16>(with_engine("backend"), two);
  ASSERT_TRUE(bf16 && bf16_backend && bf16->peak_bytes && bf16_backend->peak_bytes);
  EXPECT_EQ(*bf16->peak_bytes - *bf16_backend->peak_bytes, gradients / 2);  // bfloat16 sums
  EXPECT_THAT(bf16->lines.at(0), HasSubstr(", the copy engine's bfloat16 sums "));
  // "auto" (the default) picks the copy engines for a Replicate group that is the whole job.
  const auto automatic = d9d::advise::preflight<RepBf16>(with_engine("auto"), two);
  ASSERT_TRUE(automatic && automatic->peak_bytes);
  EXPECT_EQ(*automatic->peak_bytes, *bf16->peak_bytes);
  EXPECT_THAT(automatic->lines.at(0), HasSubstr(", the copy engine's bfloat16 sums "));
  // One rank, or FullyShard: no buffer.
  const auto one = d9d::advise::preflight<Rep>(with_engine("copy"), {});
  const auto one_backend = d9d::advise::preflight<Rep>(with_engine("backend"), {});
  ASSERT_TRUE(one && one_backend);
  EXPECT_EQ(one->peak_bytes, one_backend->peak_bytes);
  using Fsdp = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>,
                         d9d::precision::Bf16Mixed>;
  const auto fs = d9d::advise::preflight<Fsdp>(with_engine("copy"), d9d::MeshShape{.dp_shard = 2});
  const auto fs_backend =
      d9d::advise::preflight<Fsdp>(with_engine("backend"), d9d::MeshShape{.dp_shard = 2});
  ASSERT_TRUE(fs && fs_backend);
  EXPECT_EQ(fs->peak_bytes, fs_backend->peak_bytes);
}

TEST(Advise_Preflight, StepTimeFromTheProfileAndTheWarningFirst) {
  const auto path = write_profile();
  using Fsdp = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>,
                         d9d::precision::Bf16Mixed>;
  const auto config = config_with(R"({"memory_gib": 1e-6, "profile": ")" + path + R"("})");
  const auto p = d9d::advise::preflight<Fsdp>(config, d9d::MeshShape{.dp_shard = 2});
  ASSERT_TRUE(p.has_value());
  ASSERT_TRUE(p->time.has_value());
  const auto machine = d9d::advise::MachineProfile::from_file(path);
  const auto direct = d9d::advise::predict_step_time(
      model(), {.fully_shard = true, .dp_shard = 2, .microbatches = 2},
      {.microbatch_size = 2,
       .sequence_length = 16,
       .precision = d9d::advise::precision_rules("bf16_mixed"),
       .compute = d9d::advise::Compute::bf16_parameters},
      machine);
  EXPECT_DOUBLE_EQ(p->time->total, direct.total);
  EXPECT_FALSE(p->fits);
  ASSERT_EQ(p->lines.size(), 3U);
  EXPECT_THAT(p->lines[0], HasSubstr("advise: warning: the prediction exceeds memory_gib"));
  EXPECT_THAT(p->lines[0], HasSubstr("--candidates 2"));
  EXPECT_THAT(p->lines[2], HasSubstr("advise: predicted step on Test GPU: "));
  // A profile that is not there is said, not thrown.
  const auto missing = d9d::advise::preflight<Fsdp>(
      config_with(R"({"profile": "/nonexistent.json"})"), d9d::MeshShape{.dp_shard = 2});
  EXPECT_THAT(missing->lines.back(), HasSubstr("step time not predicted: "));
  EXPECT_THAT(missing->lines.back(), HasSubstr("cannot read /nonexistent.json"));
}

// A Qwen3-MoE's pre-flight: the MoE advisor's state, activations and peak for the Plan's slots
// (experts over its ep ranks; float32 experts under FullyShard in bf16 mixed when ep_replicate
// is 1), its step time from a profile with grouped experts and all-to-alls, and what it does not
// predict (a MoE model under a pipeline).
TEST(Advise_Preflight, AQwen3MoeUnderExpertParallelism) {
  const auto profile = write_profile();
  const auto config = config_with(R"({"profile": ")" + profile + R"("})", "", kMoeModel);
  const auto moe = d9d::model::Qwen3MoeConfig::from_json_text(kMoeModel);
  using ShardEp = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>,
                            d9d::parallel::ExpertParallel<>, d9d::parallel::FullyShard<>,
                            d9d::precision::Bf16Mixed>;
  const d9d::MeshShape shape{.dp_shard = 2, .ep = 2};
  const auto p = d9d::advise::preflight<ShardEp>(config, shape);
  ASSERT_TRUE(p.has_value());
  const auto rules = d9d::advise::state_rules<ShardEp>(shape);
  const auto parameters = d9d::advise::qwen3_parameters(moe);
  const auto state = d9d::advise::state_bytes(parameters, rules, 0, 0);
  EXPECT_EQ(p->state_bytes, state.total());
  // FullyShard gathers bfloat16 units and leaves the experts (over ep 2, ep_replicate 1) float32.
  const d9d::advise::ExpertSplit split{.ranks = 2, .load = 1.0, .float32_experts = true};
  const auto kept = d9d::advise::qwen3_moe_activation_bytes(
                        moe, 2, 16, d9d::advise::Compute::bf16_parameters, split)
                        .total();
  ASSERT_TRUE(p->activation_bytes.has_value());
  EXPECT_EQ(*p->activation_bytes, kept);
  ASSERT_TRUE(p->peak_bytes.has_value());
  EXPECT_EQ(*p->peak_bytes,
            d9d::advise::peak_step_bytes(state, kept, 2) +
                d9d::advise::fully_shard_gathered_step_bytes(
                    parameters, rules, d9d::advise::Compute::bf16_parameters, true));
  const auto machine = d9d::advise::MachineProfile::from_file(profile);
  const auto direct = d9d::advise::predict_step_time(
      moe, {.fully_shard = true, .dp_shard = 2, .microbatches = 2}, split,
      {.microbatch_size = 2,
       .sequence_length = 16,
       .precision = rules,
       .compute = d9d::advise::Compute::bf16_parameters},
      machine);
  ASSERT_TRUE(p->time.has_value());
  EXPECT_DOUBLE_EQ(p->time->total, direct.total);
  EXPECT_GT(p->time->expert_parallel, 0.0);
  ASSERT_EQ(p->lines.size(), 2U);
  EXPECT_THAT(p->lines[0], HasSubstr("fully_shard dp_shard 2, 2 microbatches, ep 2"));
  EXPECT_THAT(p->lines[0], HasSubstr("experts at their balanced load"));
  EXPECT_THAT(p->lines[1], HasSubstr("advise: predicted step on Test GPU: "));
  // Under a pipeline: the state, and the rest said.
  using PipedEp =
      d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::pp<2>, d9d::ep<d9d::dynamic>>,
                d9d::parallel::ExpertParallel<>, d9d::pipeline::OneFOneB<>,
                d9d::precision::Bf16Mixed>;
  const auto piped =
      d9d::advise::preflight<PipedEp>(config, d9d::MeshShape{.pp = 2, .dp_replicate = 2, .ep = 2});
  ASSERT_TRUE(piped.has_value());
  EXPECT_FALSE(piped->activation_bytes.has_value());
  EXPECT_THAT(piped->lines.at(0),
              HasSubstr("activations not predicted (a MoE model under a pipeline)"));
  EXPECT_THAT(piped->lines.at(1),
              HasSubstr("step time not predicted (a MoE model under a pipeline)"));
}

// A Qwen3-MoE under Replicate with the copy engines and a bfloat16 reduction: their buffer holds
// bfloat16 sums of the regular domain's gradients (the experts are reduced by ExpertParallel), on
// top of the peak; in the gradients' own dtype it holds the gradients themselves.
TEST(Advise_Preflight, TheCopyEnginesBufferIsInTheMoePeakWithoutTheExperts) {
  const auto with_engine = [](const std::string& engine) {
    return config_with("{}", R"({"reduce_engine": ")" + engine + R"("})", kMoeModel);
  };
  using RepEp = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>,
                          d9d::parallel::ExpertParallel<>, d9d::precision::Bf16MixedBf16Reduce>;
  using RepEpFloat32 = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>,
                                 d9d::parallel::ExpertParallel<>, d9d::precision::Bf16Mixed>;
  const d9d::MeshShape shape{.dp_replicate = 2, .ep = 2};
  const auto backend = d9d::advise::preflight<RepEp>(with_engine("backend"), shape);
  const auto copy = d9d::advise::preflight<RepEp>(with_engine("copy"), shape);
  ASSERT_TRUE(backend && copy && backend->peak_bytes && copy->peak_bytes);
  const auto parameters =
      d9d::advise::qwen3_parameters(d9d::model::Qwen3MoeConfig::from_json_text(kMoeModel));
  std::vector<d9d::advise::ParameterShape> regular;
  int64_t experts = 0;
  for (const auto& param : parameters) {
    if (param.expert) {
      ++experts;
    } else {
      regular.push_back(param);
    }
  }
  ASSERT_GT(experts, 0);
  const auto rules = d9d::advise::state_rules<RepEp>(shape);
  const auto dense = d9d::advise::state_bytes(regular, rules, 0, 0).gradients;
  EXPECT_EQ(*copy->peak_bytes - *backend->peak_bytes, dense / 2);
  EXPECT_LT(dense, d9d::advise::state_bytes(parameters, rules, 0, 0).gradients);
  EXPECT_EQ(copy->state_bytes, backend->state_bytes);
  EXPECT_THAT(copy->lines.at(0), HasSubstr(", the copy engine's bfloat16 sums "));
  EXPECT_THAT(backend->lines.at(0), Not(HasSubstr("copy engine")));
  const auto wide = d9d::advise::preflight<RepEpFloat32>(with_engine("copy"), shape);
  const auto wide_backend = d9d::advise::preflight<RepEpFloat32>(with_engine("backend"), shape);
  ASSERT_TRUE(wide && wide_backend && wide->peak_bytes && wide_backend->peak_bytes);
  EXPECT_EQ(*wide->peak_bytes, *wide_backend->peak_bytes);
}

TEST(Advise_Preflight, SaysWhatItDoesNotPredict) {
  const auto config = config_with("{}");
  // LoRA: its state (adapters, frozen base) and activations (FullTune's and LoRA's change), no
  // step time; under a pipeline its state only; not under FullyShard.
  using Lora = d9d::peft::Lora<8, 16>;
  const auto lora = d9d::advise::preflight<d9d::Plan<Lora>>(config, {});
  ASSERT_TRUE(lora.has_value());
  const auto adapted = d9d::advise::apply_peft(d9d::advise::qwen3_parameters(model()),
                                               d9d::peft::stack_spec<Lora>());
  EXPECT_EQ(lora->state_bytes,
            d9d::advise::state_bytes(adapted, d9d::advise::precision_rules("fp32"), 0).total());
  ASSERT_TRUE(lora->activation_bytes.has_value());
  const auto mb = config.batch.microbatch_size;
  const auto seq = config.batch.sequence_length;
  EXPECT_EQ(*lora->activation_bytes,
            d9d::advise::qwen3_activation_bytes(model(), mb, seq).total() +
                d9d::advise::qwen3_peft_activation_delta(model(), adapted, mb, seq));
  EXPECT_NE(*lora->activation_bytes, d9d::advise::qwen3_activation_bytes(model(), mb, seq).total());
  EXPECT_THAT(lora->lines.at(0), Not(HasSubstr("not predicted")));
  const auto piped_lora = d9d::advise::preflight<
      d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>>, d9d::pipeline::OneFOneB<>, Lora>>(
      config, d9d::MeshShape{.pp = 2});
  ASSERT_TRUE(piped_lora.has_value());
  EXPECT_GT(piped_lora->state_bytes, 0);
  EXPECT_THAT(piped_lora->lines.at(0),
              HasSubstr("activations not predicted (a PEFT policy under a pipeline)"));
  const auto sharded_lora = d9d::advise::preflight<
      d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>, Lora>>(
      config, d9d::MeshShape{.dp_shard = 2});
  ASSERT_TRUE(sharded_lora.has_value());
  EXPECT_THAT(sharded_lora->lines.at(0), HasSubstr("not predicted: "));
  EXPECT_THAT(sharded_lora->lines.at(0), HasSubstr("a PEFT policy under FullyShard"));
  // Float8: its base policy's state; its activations (float8 copies) are not predicted.
  const auto float8 = d9d::advise::preflight<d9d::Plan<d9d::precision::Float8<>>>(config, {});
  ASSERT_TRUE(float8.has_value());
  EXPECT_EQ(float8->state_bytes,
            d9d::advise::state_bytes(d9d::advise::qwen3_parameters(model()),
                                     d9d::advise::precision_rules("bf16_mixed"), 0)
                .total());
  EXPECT_FALSE(float8->activation_bytes.has_value());
  EXPECT_THAT(float8->lines.at(0), HasSubstr("activations not predicted (Float8)"));
  // Tensor parallelism: one rank's activations, with its sequence-parallel setting; under a
  // pipeline not predicted.
  using Tp = d9d::Plan<d9d::mesh<d9d::tp<2>>, d9d::parallel::TensorParallel<>>;
  const auto tp = d9d::advise::preflight<Tp>(config, d9d::MeshShape{.tp = 2});
  ASSERT_TRUE(tp.has_value());
  ASSERT_TRUE(tp->activation_bytes.has_value());
  EXPECT_EQ(*tp->activation_bytes,
            d9d::advise::qwen3_activation_bytes(model(), 2, 16, d9d::advise::Compute::float32, {},
                                                {.ranks = 2})
                .total());
  using TpSp = d9d::Plan<d9d::mesh<d9d::tp<2>>,
                         d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>>;
  const auto sp = d9d::advise::preflight<TpSp>(config, d9d::MeshShape{.tp = 2});
  ASSERT_TRUE(sp.has_value());
  ASSERT_TRUE(sp->activation_bytes.has_value());
  EXPECT_EQ(*sp->activation_bytes,
            d9d::advise::qwen3_activation_bytes(model(), 2, 16, d9d::advise::Compute::float32, {},
                                                {.ranks = 2, .sequence_parallel = true})
                .total());
  EXPECT_LT(*sp->activation_bytes, *tp->activation_bytes);
  using TpPiped = d9d::Plan<d9d::mesh<d9d::pp<2>, d9d::tp<2>>, d9d::parallel::TensorParallel<>,
                            d9d::pipeline::OneFOneB<>>;
  const auto tp_piped = d9d::advise::preflight<TpPiped>(config, d9d::MeshShape{.pp = 2, .tp = 2});
  ASSERT_TRUE(tp_piped.has_value());
  EXPECT_FALSE(tp_piped->activation_bytes.has_value());
  EXPECT_THAT(tp_piped->lines.at(0),
              HasSubstr("activations not predicted (tensor parallelism under a pipeline)"));
  // Every layer recomputed under a pipeline is predicted; every other layer is not (the policy
  // counts a rank's blocks across its stages); selective recompute without one is.
  using PipedFull =
      d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>, d9d::recompute::Full>;
  const auto full = d9d::advise::preflight<PipedFull>(config, d9d::MeshShape{.pp = 2});
  ASSERT_TRUE(full.has_value());
  EXPECT_TRUE(full->activation_bytes.has_value());
  using PipedEvery2 =
      d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>, d9d::recompute::EveryNth<2>>;
  const auto piped = d9d::advise::preflight<PipedEvery2>(config, d9d::MeshShape{.pp = 2});
  ASSERT_TRUE(piped.has_value());
  EXPECT_THAT(piped->lines.at(0),
              HasSubstr("activations not predicted (recompute of every K-th layer under a "
                        "pipeline)"));
  const auto selective =
      d9d::advise::preflight<d9d::Plan<d9d::recompute::Attention<2>>>(config, {});
  ASSERT_TRUE(selective.has_value());
  ASSERT_TRUE(selective->activation_bytes.has_value());
  EXPECT_EQ(*selective->activation_bytes,
            d9d::advise::qwen3_activation_bytes(model(), 2, 16, d9d::advise::Compute::float32,
                                                {.every_nth = 2, .attention_only = true})
                .total());
}

}  // namespace
