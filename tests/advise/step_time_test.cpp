// d9d::advise::MachineProfile, predict_step_time and rank_plans (d9d/advise/step_time.hpp,
// d9d/advise/ranking.hpp): the profile's lookups (a measured collective curve, the nearest
// measured matmul), and the step's parts against independent counts on a machine whose every
// matmul runs at one rate — the matmuls' time is 6 x tokens x the linear weights over the rate,
// tensor parallelism halves it, recompute adds the forward's third, Replicate all-reduces the
// gradient bytes state_bytes counts, FullyShard gathers and reduce-scatters them as its settings
// say, and GPipe's bubble is (p - 1) / (m + p - 1) of the step; the ranking's order and JSON.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/advise/ranking.hpp>
#include <d9d/advise/step_time.hpp>
#include <d9d/d9d.hpp>

#include "tests/support/error_of.hpp"

namespace {

using d9d::advise::Candidate;
using d9d::advise::CollectiveCurve;
using d9d::advise::Compute;
using d9d::advise::MachineProfile;
using d9d::advise::StepOptions;

constexpr double kRate = 1e14;  // every matmul's FLOP/s on the uniform machine

// A machine whose matmuls all run at kRate (one measured shape per layout: other shapes take its
// rate), with one measured attention, 1 TB/s elementwise and collectives measured on two ranks.
MachineProfile uniform_machine() {
  MachineProfile m;
  m.device = "uniform";
  m.ranks = 2;
  for (const char* layout : {"nt", "nn", "tn"}) {
    m.gemm.push_back({.m = 1024,
                      .n = 1024,
                      .k = 1024,
                      .layout = layout,
                      .seconds = 2.0 * 1024 * 1024 * 1024 / kRate});
  }
  m.attention.push_back({.batch = 1,
                         .sequence = 16,
                         .heads = 4,
                         .kv_heads = 2,
                         .head_dim = 8,
                         .forward_seconds = 1e-5,
                         .backward_seconds = 2.5e-5});
  m.memory_bytes_per_second = 1e12;
  for (const char* name : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}) {
    m.collectives[name] = CollectiveCurve{.points = {{1024, 1e-5}, {1LL << 30, 1e-2}}};
  }
  return m;
}

constexpr const char* kModel = R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
                         "rope_theta": 10000.0, "tie_word_embeddings": false})";

d9d::model::Qwen3Config model() { return d9d::model::Qwen3Config::from_json_text(kModel); }

StepOptions bf16(Compute compute = Compute::bf16_autocast) {
  return {.microbatch_size = 2,
          .sequence_length = 16,
          .precision = d9d::advise::precision_rules("bf16_mixed"),
          .compute = compute};
}

// The linear layers' weights (every 2-D parameter but the embedding; the head is untied).
double linear_weights() {
  double sum = 0;
  for (const auto& p : d9d::advise::qwen3_parameters(model())) {
    if (p.sizes.size() == 2 && p.name != "model.embed_tokens.weight") {
      sum += static_cast<double>(p.numel());
    }
  }
  return sum;
}

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(std::abs(b), 1e-30); }

TEST(Advise_MachineProfile, CollectiveCurveInterpolatesMeasuredPoints) {
  const CollectiveCurve c{.points = {{1000, 1e-5}, {100000, 1e-3}}};
  EXPECT_DOUBLE_EQ(c.seconds(1000), 1e-5);
  EXPECT_DOUBLE_EQ(c.seconds(100000), 1e-3);
  EXPECT_DOUBLE_EQ(c.seconds(10), 1e-5);         // latency below the first point
  EXPECT_NEAR(c.seconds(10000), 1e-4, 1e-12);    // log-log between the points
  EXPECT_NEAR(c.seconds(1000000), 1e-2, 1e-12);  // the last point's bandwidth beyond
  EXPECT_THROW((void)CollectiveCurve{}.seconds(1), std::logic_error);
}

TEST(Advise_MachineProfile, CollectivesScaleToTheGroupByTheRing) {
  const auto m = uniform_machine();
  const double two = m.collective_seconds("all_gather", 1LL << 30, 2);
  EXPECT_DOUBLE_EQ(two, 1e-2);
  EXPECT_DOUBLE_EQ(m.collective_seconds("all_gather", 1LL << 30, 4), two * 0.75 / 0.5);
  EXPECT_DOUBLE_EQ(m.collective_seconds("p2p", 1LL << 30, 4), two);  // one link, not a ring
  EXPECT_EQ(m.collective_seconds("all_reduce", 1LL << 30, 1), 0.0);
  auto one_gpu = m;
  one_gpu.collectives.clear();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { (void)one_gpu.collective_seconds("all_reduce", 1024, 2); }),
              ::testing::HasSubstr("no measured all_reduce (profiled on 2 GPU(s); "
                                   "tools/gpu/profile-machine"));
}

TEST(Advise_MachineProfile, NearestMeasuredMatmulGivesItsRate) {
  MachineProfile m = uniform_machine();
  m.gemm = {{.m = 1024, .n = 1024, .k = 1024, .layout = "nt", .seconds = 1e-4},
            {.m = 8192, .n = 8192, .k = 8192, .layout = "nt", .seconds = 2e-3}};
  EXPECT_DOUBLE_EQ(m.gemm_seconds(1024, 1024, 1024, "nt"), 1e-4);
  // 2048^3 is nearer 1024^3: its rate, 8x its FLOPs.
  EXPECT_DOUBLE_EQ(m.gemm_seconds(2048, 2048, 2048, "nt"), 8e-4);
  EXPECT_DOUBLE_EQ(m.gemm_seconds(8192, 8192, 4096, "nt"), 1e-3);
  EXPECT_THAT(
      d9d::testing::error_of<std::invalid_argument>([&] { (void)m.gemm_seconds(1, 1, 1, "tn"); }),
      ::testing::HasSubstr("no measured matmul of layout \"tn\""));
}

TEST(Advise_MachineProfile, ReadsTheToolsJsonAndNamesWhatIsMissing) {
  const auto m = MachineProfile::from_json_text(R"({
      "device": "X", "ranks": 2,
      "gemm": [{"m": 4, "n": 8, "k": 16, "layout": "nt", "seconds": 0.5}],
      "attention": [{"batch": 1, "sequence": 2, "heads": 3, "kv_heads": 1, "head_dim": 4,
                     "forward_seconds": 0.25, "backward_seconds": 0.75}],
      "memory_bytes_per_second": 1e12,
      "collectives": {"p2p": [[4096, 0.002], [1024, 0.001]]}})");
  EXPECT_EQ(m.device, "X");
  EXPECT_EQ(m.ranks, 2);
  ASSERT_EQ(m.gemm.size(), 1U);
  EXPECT_EQ(m.gemm[0].layout, "nt");
  EXPECT_DOUBLE_EQ(m.gemm[0].seconds, 0.5);
  ASSERT_EQ(m.attention.size(), 1U);
  EXPECT_DOUBLE_EQ(m.attention[0].backward_seconds, 0.75);
  EXPECT_TRUE(m.grouped_experts.empty());
  const auto grouped = MachineProfile::from_json_text(R"({"gemm": [], "memory_bytes_per_second": 1,
      "grouped_experts": [{"groups": 64, "rows": 65536, "hidden": 2048, "intermediate": 768,
                           "forward_seconds": 1e-3, "backward_seconds": 3e-3}]})");
  ASSERT_EQ(grouped.grouped_experts.size(), 1U);
  // The nearest measured shape at its rate: half the rows, half the time.
  const auto [forward, backward] = grouped.grouped_experts_seconds(64, 32768, 2048, 768);
  EXPECT_DOUBLE_EQ(forward, 0.5e-3);
  EXPECT_DOUBLE_EQ(backward, 1.5e-3);
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([] {
                (void)MachineProfile::from_json_text(R"({"gemm": [], "memory_bytes_per_second": 1,
                    "grouped_experts": [{"groups": 0, "rows": 1, "hidden": 1, "intermediate": 1,
                                         "forward_seconds": 1, "backward_seconds": 1}]})");
              }),
              ::testing::HasSubstr("grouped experts need sizes >= 1"));
  const auto& p2p = m.collectives.at("p2p").points;
  ASSERT_EQ(p2p.size(), 2U);
  EXPECT_EQ(p2p[0].first, 1024);  // sorted by bytes
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)MachineProfile::from_json_text(R"({"gemm": []})"); }),
              ::testing::HasSubstr("needs \"gemm\" and \"memory_bytes_per_second\""));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([] {
                (void)MachineProfile::from_json_text(
                    R"({"gemm": [{"m": 1, "n": 1, "k": 1, "layout": "xx", "seconds": 1}],
                        "memory_bytes_per_second": 1})");
              }),
              ::testing::HasSubstr("layout nt, nn or tn"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)MachineProfile::from_json_text("{"); }),
              ::testing::HasSubstr("not JSON"));
  // The host's costs (tools/gpu/profile-host), by compute and step kind.
  constexpr const char* kHosted = R"({"gemm": [], "memory_bytes_per_second": 1,
      "host": {"bf16_autocast": {"plain": {"per_layer": 1e-3, "per_microbatch": 2e-3,
                                           "per_step": 3e-3}}}})";
  const auto hosted = MachineProfile::from_json_text(kHosted);
  const auto* plain = hosted.host_cost(Compute::bf16_autocast, "plain");
  ASSERT_NE(plain, nullptr);
  EXPECT_DOUBLE_EQ(plain->per_microbatch, 2e-3);
  EXPECT_EQ(hosted.host_cost(Compute::bf16_autocast, "tensor"), nullptr);
  EXPECT_EQ(hosted.host_cost(Compute::bf16_parameters, "plain"), nullptr);
  const auto with_host = [](const std::string& host) {
    return d9d::testing::error_of<std::invalid_argument>([&] {
      (void)MachineProfile::from_json_text(R"({"gemm": [], "memory_bytes_per_second": 1,
                                               "host": )" +
                                           host + "}");
    });
  };
  EXPECT_THAT(with_host(R"({"fp8": {}})"),
              ::testing::HasSubstr("by compute bf16_autocast or bf16_parameters, not fp8"));
  EXPECT_THAT(with_host(R"({"bf16_autocast": {"graphs": {"per_layer": 0, "per_microbatch": 0,
                                                          "per_step": 0}}})"),
              ::testing::HasSubstr("plain, pipelined or tensor, not graphs"));
  EXPECT_THAT(with_host(R"({"bf16_autocast": {"plain": {"per_layer": -1, "per_microbatch": 0,
                                                         "per_step": 0}}})"),
              ::testing::HasSubstr(">= 0 seconds (bf16_autocast, plain)"));
  EXPECT_THAT(with_host(R"({"bf16_autocast": {"plain": {"per_layer": 1}}})"),
              ::testing::HasSubstr("malformed"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)MachineProfile::from_file("/nonexistent/profile.json"); }),
              ::testing::HasSubstr("cannot read /nonexistent/profile.json"));
}

TEST(Advise_StepTime, MatmulsAreSixFlopsPerWeightAndTokenAtTheRate) {
  const auto m = uniform_machine();
  const Candidate one{.microbatches = 3};
  const auto t = d9d::advise::predict_step_time(model(), one, bf16(), m);
  const double tokens = 3.0 * 2 * 16;
  EXPECT_TRUE(near(t.gemm, 6.0 * tokens * linear_weights() / kRate)) << t.gemm;
  EXPECT_EQ(t.tokens, 96);
  // One rank, no pipeline: the step is its parts.
  EXPECT_TRUE(near(t.total, t.gemm + t.attention + t.memory + t.optimizer));
  EXPECT_EQ(t.bubble, 0.0);
  EXPECT_EQ(t.data_parallel, 0.0);
  EXPECT_TRUE(near(t.tokens_per_second(), 96.0 / t.total));

  // Attention: the measured shape's forward and backward per layer and microbatch (the model's
  // heads, microbatch 2: twice the measured batch's FLOPs).
  EXPECT_TRUE(near(t.attention, 3 * 4 * 2 * (1e-5 + 2.5e-5)));

  // Full recompute runs the layers' forward again: their matmuls' forward third once more (not
  // the head's), and the attention's forward.
  double head = 0;
  double attention_weights = 0;
  for (const auto& p : d9d::advise::qwen3_parameters(model())) {
    if (p.name == "lm_head.weight") {
      head = static_cast<double>(p.numel());
    }
    if (p.sizes.size() == 2 && p.name.find("self_attn") != std::string::npos) {
      attention_weights += static_cast<double>(p.numel());
    }
  }
  ASSERT_GT(head, 0.0);
  ASSERT_GT(attention_weights, 0.0);
  auto recomputed = bf16();
  recomputed.recompute = d9d::advise::Recompute::full();
  const auto r = d9d::advise::predict_step_time(model(), one, recomputed, m);
  EXPECT_TRUE(near(r.gemm, t.gemm + 2.0 * tokens * (linear_weights() - head) / kRate)) << r.gemm;
  EXPECT_TRUE(near(r.attention, t.attention + 3 * 4 * 2 * 1e-5));
  EXPECT_GT(r.total, t.total);
  // Every other layer (EveryNth<2>, 4 layers): half of that.
  recomputed.recompute = {.every_nth = 2};
  const auto half = d9d::advise::predict_step_time(model(), one, recomputed, m);
  EXPECT_TRUE(near(half.gemm, t.gemm + 1.0 * tokens * (linear_weights() - head) / kRate));
  EXPECT_TRUE(near(half.attention, t.attention + 3 * 2 * 2 * 1e-5));
  // Selective (Attention<1>): the attention part's matmuls (q, k, v, o) and the attention.
  recomputed.recompute = {.every_nth = 1, .attention_only = true};
  const auto selective = d9d::advise::predict_step_time(model(), one, recomputed, m);
  EXPECT_TRUE(near(selective.gemm, t.gemm + 2.0 * tokens * attention_weights / kRate));
  EXPECT_TRUE(near(selective.attention, r.attention));
  EXPECT_LT(selective.total, r.total);
  EXPECT_GT(selective.total, t.total);
}

TEST(Advise_StepTime, TensorParallelHalvesTheMatmulsAndAddsItsCollectives) {
  const auto m = uniform_machine();
  const auto t1 = d9d::advise::predict_step_time(model(), {.microbatches = 2}, bf16(), m);
  const auto t2 = d9d::advise::predict_step_time(model(), {.tp = 2, .microbatches = 2}, bf16(), m);
  EXPECT_TRUE(near(t2.gemm, t1.gemm / 2));
  // Per microbatch and layer two all-gathers and two reduce-scatters forward, as many backward,
  // one of each more around the head; [tokens, hidden] of the residual stream, float32 under
  // autocast.
  const int64_t bytes = int64_t{2} * 16 * 32 * 4;
  const double pair = m.collective_seconds("all_gather", bytes, 2) +
                      m.collective_seconds("reduce_scatter", bytes, 2);
  EXPECT_TRUE(near(t2.tensor_parallel, 2 * (4 * 4 + 2) * pair));
  EXPECT_EQ(t2.tokens, t1.tokens);  // tp ranks share their tokens
}

TEST(Advise_StepTime, DataParallelMovesTheStatesGradientBytes) {
  const auto m = uniform_machine();
  auto rules = d9d::advise::precision_rules("bf16_mixed");
  const auto grads = d9d::advise::state_bytes(d9d::advise::qwen3_parameters(model()), rules, 0);
  // Replicate over two ranks: one all-reduce of the float32 gradients per step.
  const auto rep =
      d9d::advise::predict_step_time(model(), {.dp_replicate = 2, .microbatches = 2}, bf16(), m);
  EXPECT_TRUE(near(rep.data_parallel, m.collective_seconds("all_reduce", grads.gradients, 2)));
  EXPECT_EQ(rep.tokens, 2 * 2 * 2 * 16);
  auto in_bf16 = bf16();
  in_bf16.reduce_bf16 = true;
  const auto rep16 =
      d9d::advise::predict_step_time(model(), {.dp_replicate = 2, .microbatches = 2}, in_bf16, m);
  EXPECT_TRUE(
      near(rep16.data_parallel, m.collective_seconds("all_reduce", grads.gradients / 2, 2)));

  // FullyShard over two: bfloat16 gathers forward and backward per microbatch, a reduce-scatter
  // of the float32 gradients per microbatch; reshard never and one reduce: one of each.
  const Candidate fsdp{.fully_shard = true, .dp_shard = 2, .microbatches = 3};
  const int64_t elements = grads.gradients / 4;
  const double gather = m.collective_seconds("all_gather", elements * 2, 2);
  const double reduce = m.collective_seconds("reduce_scatter", grads.gradients, 2);
  const auto each =
      d9d::advise::predict_step_time(model(), fsdp, bf16(Compute::bf16_parameters), m);
  EXPECT_TRUE(near(each.data_parallel, 6 * gather + 3 * reduce));
  auto once = bf16(Compute::bf16_parameters);
  once.reshard_after_forward = false;
  once.reduce_every_microbatch = false;
  const auto o = d9d::advise::predict_step_time(model(), fsdp, once, m);
  EXPECT_TRUE(near(o.data_parallel, gather + reduce));
  EXPECT_EQ(o.data_parallel_exposed, o.data_parallel);  // not hidden (the file comment)
  EXPECT_TRUE(near(o.total, o.gemm + o.attention + o.memory + o.optimizer + o.data_parallel));
  // On one rank FullyShard still copies: each gather casts the float32 shard into the bfloat16
  // gather input (4 + 2 bytes per element), each reduction lays the bfloat16 gradients out as
  // float32 (2 + 4) and adds into the shard's gradient (3 x 4).
  const auto alone = d9d::advise::predict_step_time(
      model(), {.fully_shard = true, .microbatches = 3}, bf16(Compute::bf16_parameters), m);
  const auto plain = d9d::advise::predict_step_time(model(), {.microbatches = 3},
                                                    bf16(Compute::bf16_parameters), m);
  const auto w = static_cast<double>(elements);
  EXPECT_TRUE(near(alone.memory - plain.memory, (6 * w * 6 + 3 * (w * 6 + w * 12)) / 1e12));
  EXPECT_EQ(alone.data_parallel, 0.0);
  // The optimizer runs on half the parameters.
  const auto whole = d9d::advise::predict_step_time(model(), {.microbatches = 3},
                                                    bf16(Compute::bf16_parameters), m);
  EXPECT_LT(each.optimizer, whole.optimizer * 0.6);
}

TEST(Advise_StepTime, GPipesBubbleIsItsClosedForm) {
  const auto m = uniform_machine();
  for (const int micro : {2, 4, 8}) {
    const auto t = d9d::advise::predict_step_time(
        model(), {.pp = 2, .schedule = "gpipe", .microbatches = micro}, bf16(), m);
    const double makespan = t.total - t.optimizer - t.data_parallel_exposed;
    EXPECT_NEAR(t.bubble / makespan, 1.0 / (micro + 1), 1e-9) << micro;
    EXPECT_GT(t.pipeline_p2p, 0.0);
  }
  // 1F1B's program idles as long as GPipe's at these uniform costs; ZB-H1's fills some of it.
  const auto ofob = d9d::advise::predict_step_time(
      model(), {.pp = 2, .schedule = "1f1b", .microbatches = 4}, bf16(), m);
  const auto zb = d9d::advise::predict_step_time(
      model(), {.pp = 2, .schedule = "zbh1", .microbatches = 4}, bf16(), m);
  EXPECT_LT(zb.bubble, ofob.bubble);
}

TEST(Advise_StepTime, TheHostBoundsTheStepWhereItWasMeasured) {
  // The uniform machine's kernels take microseconds; a host that takes milliseconds per layer is
  // the step's time: per step + microbatches x (per microbatch + layers x per layer), the
  // kernels' parts unchanged. A negligible host leaves the step the kernels'; a compute or step
  // kind the profile did not measure gets no host term.
  auto m = uniform_machine();
  const auto device = d9d::advise::predict_step_time(model(), {.microbatches = 3}, bf16(), m);
  m.host["bf16_autocast"]["plain"] = {.per_layer = 1e-3, .per_microbatch = 2e-3, .per_step = 5e-3};
  const auto bound = d9d::advise::predict_step_time(model(), {.microbatches = 3}, bf16(), m);
  EXPECT_TRUE(near(bound.host, 5e-3 + 3 * (2e-3 + 4 * 1e-3))) << bound.host;
  EXPECT_TRUE(near(bound.total, bound.host));
  EXPECT_TRUE(near(bound.gemm, device.gemm));
  EXPECT_GT(bound.total, 10 * device.total);
  m.host["bf16_autocast"]["plain"] = {.per_layer = 1e-12, .per_microbatch = 0, .per_step = 0};
  const auto light = d9d::advise::predict_step_time(model(), {.microbatches = 3}, bf16(), m);
  EXPECT_TRUE(near(light.total, device.total));
  EXPECT_TRUE(near(light.host, 3 * 4 * 1e-12));
  const auto params = d9d::advise::predict_step_time(model(), {.microbatches = 3},
                                                     bf16(Compute::bf16_parameters), m);
  EXPECT_EQ(params.host, 0.0);
  const auto tensor =
      d9d::advise::predict_step_time(model(), {.tp = 2, .microbatches = 3}, bf16(), m);
  EXPECT_EQ(tensor.host, 0.0) << "tp measured as its own kind";
  m.host["bf16_autocast"]["tensor"] = {.per_layer = 1e-3, .per_microbatch = 0, .per_step = 0};
  const auto tensor_bound =
      d9d::advise::predict_step_time(model(), {.tp = 2, .microbatches = 3}, bf16(), m);
  EXPECT_TRUE(near(tensor_bound.total, 3 * 4 * 1e-3));

  // Under a pipeline each action takes its share of the stage's host time (the forward 0.34,
  // the backward the rest): GPipe over pp 2 with 4 microbatches of 2 layers a stage runs
  // (4 + 1) x the stage's host time, h = (2 x per layer + per microbatch) per microbatch, and the
  // rank's host alone would take 4 h.
  m.host["bf16_autocast"]["pipelined"] = {.per_layer = 1e-3, .per_microbatch = 2e-3, .per_step = 0};
  const auto piped = d9d::advise::predict_step_time(
      model(), {.pp = 2, .schedule = "gpipe", .microbatches = 4}, bf16(), m);
  const double h = 2 * 1e-3 + 2e-3;
  EXPECT_NEAR(piped.host, 4 * h, 1e-12);
  EXPECT_NEAR(piped.total, 5 * h, 1e-2 * h) << "the program at the host's action times";
  EXPECT_NEAR(piped.bubble / (piped.total - piped.optimizer), 1.0 / 5, 1e-2);
}

// A Qwen3-MoE of 4 layers, layer 0 dense: 3 MoE layers of 4 experts, top 2, over hidden 32.
d9d::model::Qwen3MoeConfig moe_model() {
  return d9d::model::Qwen3MoeConfig::from_json_text(
      R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "tie_word_embeddings": false, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0]})");
}

TEST(Advise_StepTime, MoeLayersRunTheirExpertsAndAllToAlls) {
  auto m = uniform_machine();
  // A microbatch's 32 tokens x top 2 = 64 rows over ep 2's 2 experts per rank, measured exactly.
  m.grouped_experts.push_back({.groups = 2,
                               .rows = 64,
                               .hidden = 32,
                               .intermediate = 16,
                               .forward_seconds = 1e-4,
                               .backward_seconds = 2e-4});
  const auto moe = moe_model();
  const Candidate two{.dp_replicate = 2, .microbatches = 3};
  const auto t = d9d::advise::predict_step_time(moe, two, {.ranks = 2}, bf16(), m);
  EXPECT_EQ(t.tokens, 2 * 3 * 2 * 16);
  // The experts: the measured time per MoE layer and microbatch.
  EXPECT_TRUE(near(t.experts, 3 * 3 * 3e-4)) << t.experts;
  // Four all-to-alls of the routed rows (64 x 32 bfloat16) and one of the counts (4 x 8 bytes)
  // per MoE layer and microbatch.
  const double moved = 4 * m.collective_seconds("all_to_all", int64_t{64} * 32 * 2, 2) +
                       m.collective_seconds("all_to_all", int64_t{4} * 8, 2);
  EXPECT_TRUE(near(t.expert_parallel, 3 * 3 * moved)) << t.expert_parallel;
  // The matmuls: every 2-D weight but the embedding (attention, layer 0's MLP, the routers, the
  // head), 6 FLOPs per weight and token at the rate; the experts are not among them.
  double linear = 0;
  int64_t experts = 0;
  int64_t others = 0;
  for (const auto& p : d9d::advise::qwen3_parameters(moe)) {
    (p.expert ? experts : others) += p.numel();
    if (p.sizes.size() == 2 && p.name != "model.embed_tokens.weight") {
      linear += static_cast<double>(p.numel());
    }
  }
  EXPECT_TRUE(near(t.gemm, 6.0 * 96 * linear / kRate)) << t.gemm;
  // Replicate over the two ep ranks: the experts have no replica to reduce with; the rest's
  // float32 gradients are all-reduced.
  EXPECT_TRUE(near(t.data_parallel, m.collective_seconds("all_reduce", others * 4, 2)));
  EXPECT_TRUE(near(t.total, t.gemm + t.attention + t.memory + t.optimizer + t.experts +
                                t.expert_parallel + t.data_parallel));
  // A rank whose experts get twice their rows: the experts' time (the measured shape scaled by
  // FLOPs) doubles, the all-to-alls move twice the rows.
  const auto loaded = d9d::advise::predict_step_time(moe, two, {.ranks = 2, .load = 2}, bf16(), m);
  EXPECT_TRUE(near(loaded.experts, 2 * t.experts));
  const double moved_twice = 4 * m.collective_seconds("all_to_all", int64_t{2} * 64 * 32 * 2, 2) +
                             m.collective_seconds("all_to_all", int64_t{4} * 8, 2);
  EXPECT_TRUE(near(loaded.expert_parallel, 3 * 3 * moved_twice));
  // Four data-parallel ranks over ep 2: each rank's experts have one replica (ep_replicate 2) to
  // all-reduce their gradients with, the rest all-reduce over the four.
  const auto four = d9d::advise::predict_step_time(moe, {.dp_replicate = 4, .microbatches = 3},
                                                   {.ranks = 2}, bf16(), m);
  EXPECT_TRUE(near(four.data_parallel, m.collective_seconds("all_reduce", others * 4, 4) +
                                           m.collective_seconds("all_reduce", experts / 2 * 4, 2)));
  // FullyShard over the two: the non-expert parameters gathered and reduce-scattered as for a
  // dense model, the experts (whole on each rank) not at all.
  const auto sharded =
      d9d::advise::predict_step_time(moe, {.fully_shard = true, .dp_shard = 2, .microbatches = 3},
                                     {.ranks = 2}, bf16(Compute::bf16_parameters), m);
  EXPECT_TRUE(
      near(sharded.data_parallel, 6 * m.collective_seconds("all_gather", others * 2, 2) +
                                      3 * m.collective_seconds("reduce_scatter", others * 4, 2)));
  // HSDP, 2 replicas x FullyShard 2, over ep 2: each replica holds every expert group once
  // (ep_replicate 1), so the experts stay whole and are all-reduced over the two replicas; the
  // rest as for a dense model, its shards all-reduced over the replicas too.
  const auto hsdp = d9d::advise::predict_step_time(
      moe, {.fully_shard = true, .dp_replicate = 2, .dp_shard = 2, .microbatches = 3}, {.ranks = 2},
      bf16(Compute::bf16_parameters), m);
  EXPECT_TRUE(
      near(hsdp.data_parallel, 6 * m.collective_seconds("all_gather", others * 2, 2) +
                                   3 * m.collective_seconds("reduce_scatter", others * 4, 2) +
                                   m.collective_seconds("all_reduce", others * 4 / 2, 2) +
                                   m.collective_seconds("all_reduce", experts / 2 * 4, 2)));
  // FullyShard 4 over ep 2: ep_replicate 2 shards each expert group over two ranks, which gather
  // and reduce-scatter it as FullyShard's units.
  const auto four_shards =
      d9d::advise::predict_step_time(moe, {.fully_shard = true, .dp_shard = 4, .microbatches = 3},
                                     {.ranks = 2}, bf16(Compute::bf16_parameters), m);
  EXPECT_TRUE(near(four_shards.data_parallel,
                   6 * m.collective_seconds("all_gather", others * 2, 4) +
                       3 * m.collective_seconds("reduce_scatter", others * 4, 4) +
                       6 * m.collective_seconds("all_gather", experts / 2 * 2, 2) +
                       3 * m.collective_seconds("reduce_scatter", experts / 2 * 4, 2)));

  const auto error = [&](const Candidate& c, d9d::advise::ExpertSplit split,
                         const MachineProfile& machine) {
    return d9d::testing::error_of<std::invalid_argument>(
        [&] { (void)d9d::advise::predict_step_time(moe, c, split, bf16(), machine); });
  };
  EXPECT_THAT(error({.dp_replicate = 2, .pp = 2, .microbatches = 2}, {.ranks = 2}, m),
              ::testing::HasSubstr("not predicted under a pipeline"));
  EXPECT_THAT(error({.dp_replicate = 3, .microbatches = 2}, {.ranks = 3}, m),
              ::testing::HasSubstr("ep 3 must divide the 4 experts"));
  EXPECT_THAT(error(two, {.ranks = 2}, uniform_machine()),
              ::testing::HasSubstr("no measured grouped experts"));
  auto lora = bf16();
  lora.peft = d9d::peft::stack_spec<d9d::peft::Lora<4, 8>>();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { (void)d9d::advise::predict_step_time(moe, two, {.ranks = 2}, lora, m); }),
              ::testing::HasSubstr("a PEFT policy is not predicted on a Qwen3-MoE yet"));
}

// A PEFT policy: the frozen linear layers' weight gradients (tn GEMMs) drop out, each adapter's six
// thin GEMMs come in (at the longer of their FLOPs at the rate and their bfloat16 operands' bytes
// at 1 TB/s), and only what trains accumulates gradients, is all-reduced and updated by AdamW.
TEST(Advise_StepTime, PeftSkipsFrozenWeightGradientsAndAddsTheAdaptersGemms) {
  const auto m = uniform_machine();
  const Candidate one{.microbatches = 3};
  const double mbs = 3;
  const int64_t tokens = int64_t{2} * 16;
  const auto thin = [&](double rows, double n, double k) {
    return std::max(2 * rows * n * k / kRate, 2 * (rows * k + k * n + rows * n) / 1e12);
  };
  const auto full = d9d::advise::predict_step_time(model(), one, bf16(), m);
  // FullTune as a stack: nothing changes.
  auto same = bf16();
  same.peft = d9d::peft::stack_spec<d9d::peft::FullTune>();
  const auto as_full = d9d::advise::predict_step_time(model(), one, same, m);
  EXPECT_EQ(as_full.total, full.total);
  EXPECT_EQ(as_full.gemm, full.gemm);

  // Each adapter's GEMMs; where `stacked` (q, k, v and gate, up of one layer, all adapted at one
  // scale: one node) the group's h and x-gradient GEMMs run once over the ranks summed.
  const auto adapter_seconds = [&](const std::vector<d9d::advise::ParameterShape>& adapted,
                                   bool stacked) {
    double sum = 0;
    std::map<std::string, std::pair<double, double>> groups;  // -> (ranks, in)
    for (std::size_t i = 0; i < adapted.size(); ++i) {
      const auto& p = adapted[i];
      if (!p.name.ends_with("lora_A.weight")) {
        continue;
      }
      const auto r = static_cast<double>(p.sizes[0]);
      const auto in = static_cast<double>(p.sizes[1]);
      const auto out = static_cast<double>(adapted[i + 1].sizes[0]);
      sum +=
          thin(tokens, out, r) + thin(tokens, r, out) + thin(r, in, tokens) + thin(out, r, tokens);
      const auto layer = p.name.substr(0, p.name.find('.', p.name.find("layers.") + 7));
      const bool attention = p.name.find("_proj.lora_A") != std::string::npos &&
                             (p.name.find("q_proj") != std::string::npos ||
                              p.name.find("k_proj") != std::string::npos ||
                              p.name.find("v_proj") != std::string::npos);
      const bool gate_up = p.name.find("gate_proj") != std::string::npos ||
                           p.name.find("up_proj") != std::string::npos;
      if (stacked && (attention || gate_up)) {
        auto& g = groups[layer + (attention ? "qkv" : "gate_up")];
        g.first += r;
        g.second = in;
      } else {
        sum += thin(tokens, r, in) + thin(tokens, in, r);
      }
    }
    for (const auto& [name, g] : groups) {
      sum += thin(tokens, g.first, g.second) + thin(tokens, g.second, g.first);
    }
    return sum;
  };
  auto lora = bf16();
  lora.peft = d9d::peft::stack_spec<d9d::peft::Lora<4, 8>>();
  const auto adapted = d9d::advise::apply_peft(d9d::advise::qwen3_parameters(model()), *lora.peft);
  double frozen_linear = 0;
  double frozen = 0;
  int adapted_layers = 0;
  std::vector<d9d::advise::ParameterShape> trained;
  for (const auto& p : adapted) {
    if (p.trained) {
      trained.push_back(p);
    } else {
      frozen += static_cast<double>(p.numel());
      if (p.sizes.size() == 2 && p.name != "model.embed_tokens.weight") {
        frozen_linear += static_cast<double>(p.numel());
      }
    }
    if (p.name.ends_with("lora_A.weight")) {
      ++adapted_layers;
      EXPECT_EQ(p.lora_scale, 2.0) << p.name;
    }
  }
  ASSERT_EQ(adapted_layers, 4 * 7);  // every layer's q, k, v, o, gate, up, down; not the head
  const double adapters = adapter_seconds(adapted, true);
  EXPECT_LT(adapters, adapter_seconds(adapted, false));
  ASSERT_GT(frozen_linear, 0.0);
  const auto t = d9d::advise::predict_step_time(model(), one, lora, m);
  EXPECT_TRUE(near(t.gemm, full.gemm + mbs * (adapters - 2.0 * tokens * frozen_linear / kRate)))
      << t.gemm << " " << full.gemm;
  // Under autocast every weight is still cast once per step (4 + 2 bytes per element), the
  // adapters' too; only what trains accumulates a float32 gradient (4 + 4 bytes per element and
  // microbatch): here the adapters alone.
  double adapter_elements = 0;
  for (const auto& p : trained) {
    ASSERT_NE(p.name.find(".lora_"), std::string::npos) << p.name;  // LoRA alone freezes the rest
    adapter_elements += static_cast<double>(p.numel());
  }
  EXPECT_TRUE(near(full.memory - t.memory,
                   (mbs * (frozen - adapter_elements) * 8 - adapter_elements * 6) / 1e12));
  const auto rules = d9d::advise::precision_rules("bf16_mixed");
  const auto updated = d9d::advise::state_bytes(trained, rules, 0);
  EXPECT_TRUE(near(t.optimizer, static_cast<double>(2 * updated.parameters + 5 * updated.gradients +
                                                    2 * updated.optimizer) /
                                    1e12));
  EXPECT_LT(t.optimizer, full.optimizer / 2);
  // Replicate all-reduces the trained parameters' gradients only.
  const auto rep =
      d9d::advise::predict_step_time(model(), {.dp_replicate = 2, .microbatches = 3}, lora, m);
  EXPECT_TRUE(near(rep.data_parallel, m.collective_seconds("all_reduce", updated.gradients, 2)));

  // Adapters of two scales in one group (q and k at 2, v at 1), or a group not every layer of
  // which is adapted (q and v), run a node per layer: nothing stacked.
  for (const auto& spec :
       {d9d::peft::stack_spec<d9d::peft::Stack<d9d::peft::Lora<4, 8, "q_proj", "k_proj">,
                                               d9d::peft::Lora<4, 4, "v_proj">>>(),
        d9d::peft::stack_spec<d9d::peft::Lora<4, 8, "q_proj", "v_proj">>()}) {
    auto apart = bf16();
    apart.peft = spec;
    const auto listed = d9d::advise::apply_peft(d9d::advise::qwen3_parameters(model()), spec);
    double frozen_apart = 0;
    for (const auto& p : listed) {
      if (!p.trained && p.sizes.size() == 2 && p.name != "model.embed_tokens.weight") {
        frozen_apart += static_cast<double>(p.numel());
      }
    }
    const auto split = d9d::advise::predict_step_time(model(), one, apart, m);
    EXPECT_TRUE(near(split.gemm, full.gemm + mbs * (adapter_seconds(listed, false) -
                                                    2.0 * tokens * frozen_apart / kRate)))
        << split.gemm;
  }

  // A tied head with the embedding frozen computes no weight gradient for it either.
  auto tied_json = nlohmann::json::parse(kModel);
  tied_json["tie_word_embeddings"] = true;
  const auto tied = d9d::model::Qwen3Config::from_json_text(tied_json.dump());
  auto freeze = bf16();
  freeze.peft = d9d::peft::stack_spec<d9d::peft::Freeze<"model.embed_tokens">>();
  const auto tied_full = d9d::advise::predict_step_time(tied, one, bf16(), m);
  const auto tied_frozen = d9d::advise::predict_step_time(tied, one, freeze, m);
  EXPECT_TRUE(near(tied_full.gemm - tied_frozen.gemm, mbs * 2.0 * tokens * 64 * 32 / kRate));
  EXPECT_TRUE(near(tied_full.memory - tied_frozen.memory, mbs * 64 * 32 * 8 / 1e12));

  // Not predicted yet: a pipeline, tensor parallelism, FullyShard, recompute, a Qwen3-MoE.
  const auto refused = [&](const Candidate& c, const StepOptions& o) {
    return d9d::testing::error_of<std::invalid_argument>(
        [&] { (void)d9d::advise::predict_step_time(model(), c, o, m); });
  };
  const auto why = ::testing::HasSubstr(
      "a PEFT policy is predicted without a pipeline, tensor parallelism, FullyShard or "
      "recompute so far");
  EXPECT_THAT(refused({.pp = 2, .schedule = "1f1b", .microbatches = 2}, lora), why);
  EXPECT_THAT(refused({.tp = 2}, lora), why);
  EXPECT_THAT(refused({.fully_shard = true, .dp_shard = 2}, lora), why);
  auto recomputed = lora;
  recomputed.recompute = d9d::advise::Recompute::full();
  EXPECT_THAT(refused(one, recomputed), why);
}

TEST(Advise_StepTime, ErrorsNameTheFix) {
  const auto m = uniform_machine();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                (void)d9d::advise::predict_step_time(model(), {}, bf16(Compute::float32), m);
              }),
              ::testing::HasSubstr("float32 steps are not predicted"));
  auto bad = bf16();
  bad.microbatch_size = 0;
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { (void)d9d::advise::predict_step_time(model(), {}, bad, m); }),
              ::testing::HasSubstr("must be at least 1"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)d9d::advise::precision_rules("fp16"); }),
              ::testing::HasSubstr("unknown precision \"fp16\""));
  EXPECT_EQ(d9d::advise::compute_of("bf16_mixed", false), Compute::bf16_autocast);
  EXPECT_EQ(d9d::advise::compute_of("bf16_mixed", true), Compute::bf16_parameters);
  EXPECT_EQ(d9d::advise::compute_of("bf16_params", false), Compute::bf16_parameters);
  EXPECT_EQ(d9d::advise::compute_of("fp32", true), Compute::float32);
}

d9d::TrainerConfig config() {
  return d9d::TrainerConfig::from_json_text(
      std::string(R"({"run": {"output_dir": "unused", "total_steps": 1},
          "batch": {"global_batch_size": 8, "microbatch_size": 2, "sequence_length": 16},
          "model": )") +
      kModel + "}");
}

TEST(Advise_Ranking, FittingPlansFirstFastestFirstAndAsJson) {
  const auto m = uniform_machine();
  const auto all = d9d::advise::enumerate_candidates(config(), 4);
  const auto ranked = d9d::advise::rank_plans(config(), 4, {.machine = &m});
  ASSERT_EQ(ranked.size(), all.size());
  std::set<std::string> seen;
  for (const auto& r : ranked) {
    seen.insert(r.plan.describe());
    EXPECT_TRUE(r.fits);
    ASSERT_TRUE(r.time.has_value()) << r.plan.describe();
    EXPECT_GT(r.state_bytes, 0);
    // Activations are predicted without cp, and without tp under a pipeline.
    EXPECT_EQ(r.activation_bytes.has_value(), r.plan.cp == 1 && (r.plan.tp == 1 || r.plan.pp == 1))
        << r.plan.describe();
  }
  EXPECT_EQ(seen.size(), all.size());
  for (std::size_t i = 1; i < ranked.size(); ++i) {
    const bool same_group =
        ranked[i - 1].activation_bytes.has_value() == ranked[i].activation_bytes.has_value();
    if (same_group) {
      EXPECT_GE(ranked[i - 1].time->tokens_per_second(), ranked[i].time->tokens_per_second());
    } else {
      EXPECT_TRUE(ranked[i - 1].activation_bytes.has_value());  // predicted ones first
    }
  }
  // A memory below every prediction: nothing fits; the order keeps the predicted ones first.
  const auto none = d9d::advise::rank_plans(config(), 4, {.memory_bytes = 1, .machine = &m});
  for (const auto& r : none) {
    EXPECT_FALSE(r.fits);
  }
  // Without a profile no step time; float32 is not timed either.
  for (const auto& r : d9d::advise::rank_plans(config(), 2, {})) {
    EXPECT_FALSE(r.time.has_value());
  }
  for (const auto& r : d9d::advise::rank_plans(config(), 2, {.precision = "fp32", .machine = &m})) {
    EXPECT_FALSE(r.time.has_value());
  }
  const auto json = nlohmann::json::parse(d9d::advise::ranking_json(ranked));
  ASSERT_EQ(json.size(), ranked.size());
  EXPECT_EQ(json[0]["plan"], ranked[0].plan.describe());
  EXPECT_EQ(json[0]["tp"], ranked[0].plan.tp);
  EXPECT_DOUBLE_EQ(json[0]["tokens_per_second"].get<double>(), ranked[0].time->tokens_per_second());
  EXPECT_EQ(json[0]["state_bytes"].get<int64_t>(), ranked[0].state_bytes);
  EXPECT_TRUE(json.back()["activation_bytes"].is_null() ||
              json.back()["activation_bytes"].is_number());
}

}  // namespace

namespace {

// d9d::advise::peak_step_bytes and peak_rank_step_bytes: parameters and moments throughout, the
// activations in flight, the gradients from the first backward on.
TEST(Advise_PeakStep, GradientsCountFromTheFirstBackward) {
  const d9d::advise::StateBytes state{.parameters = 10, .gradients = 3, .optimizer = 20};
  // F0 B0: the larger of the activations and the gradients; F0 B0 F1 B1: both.
  EXPECT_EQ(d9d::advise::peak_step_bytes(state, 5, 1), 30 + 5);
  EXPECT_EQ(d9d::advise::peak_step_bytes(state, 2, 1), 30 + 3);
  EXPECT_EQ(d9d::advise::peak_step_bytes(state, 5, 2), 30 + 5 + 3);
  EXPECT_THROW((void)d9d::advise::peak_step_bytes(state, 5, 0), std::invalid_argument);

  const d9d::advise::StateBytes big{.parameters = 10, .gradients = 7, .optimizer = 20};
  const std::vector<int64_t> per_stage{100, 1};
  // GPipe: every forward before any backward. Rank 0 peaks at its four microbatches (400; after
  // B0, 300 + 7); rank 1, whose microbatches are small, after B0: three in flight and the
  // gradients (3 + 7 > 4).
  const auto gpipe = d9d::pipeline::GPipe<>::build(2, 4);
  EXPECT_EQ(d9d::advise::peak_rank_step_bytes(gpipe, 0, per_stage, big), 30 + 4 * 100);
  EXPECT_EQ(d9d::advise::peak_rank_step_bytes(gpipe, 1, per_stage, big), 30 + 3 * 1 + 7);
  // 1F1B on rank 0: F0 F1 B0 F2 ...: two in flight before the first backward (200), then two in
  // flight with the gradients (200 + 7).
  const auto ofob = d9d::pipeline::OneFOneB<>::build(2, 4);
  EXPECT_EQ(d9d::advise::peak_rank_step_bytes(ofob, 0, per_stage, big), 30 + 200 + 7);
  EXPECT_EQ(d9d::advise::peak_rank_activation_bytes(ofob, 0, per_stage), 200);
}

}  // namespace
