// The executor and stage models in one process: layer distribution, stages that compose to the
// whole model, every schedule with all its stages on one rank (local hand-over), pairs run at once
// (overlap_pairs), the recorded timeline and its picture, and the errors.
#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/model/qwen3_moe.hpp>
#include <d9d/model/stage_layers.hpp>
#include <d9d/pipeline/pairs.hpp>
#include <d9d/pipeline/picture.hpp>

#include "tests/pipeline_run/pipeline_fixture.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::model::distribute_layers;
using d9d::model::LayerRange;
using ::testing::HasSubstr;

TEST(Pipeline_Layers, EvenSplitsAndVirtualLayers) {
  EXPECT_EQ(distribute_layers(8, 4), (std::vector<LayerRange>{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  // 8 layers + embedding 1 + head 1 = 10 units, 2.5 per stage.
  EXPECT_EQ(distribute_layers(8, 4, {.embedding = 1, .head = 1}),
            (std::vector<LayerRange>{{0, 2}, {2, 4}, {4, 7}, {7, 8}}));
  // Fewer layers than stages: some stages hold only their virtual layers.
  const auto sparse = distribute_layers(2, 4);
  int total = 0;
  for (std::size_t s = 0; s < sparse.size(); ++s) {
    EXPECT_GE(sparse[s].size(), 0);
    if (s > 0) {
      EXPECT_EQ(sparse[s].begin, sparse[s - 1].end);
    }
    total += sparse[s].size();
  }
  EXPECT_EQ(total, 2);
  static_assert(distribute_layers(28, 4, {.embedding = 1.0, .head = 2.0}).back().end == 28);
  EXPECT_THROW((void)distribute_layers(4, 0), std::invalid_argument);
}

// The embedding's and the head's weights from FLOPs, computed here from the published shapes.
TEST(Pipeline_Layers, VirtualLayersFromFlops) {
  const d9d::model::Qwen3Config small;  // the defaults are Qwen3-0.6B's
  // A decoder layer's matmul parameters: q and o 1024 x 2048, k and v 1024 x 1024, the MLP
  // 3 x 1024 x 3072; the norms (2 x 1024 + 2 x 128) ride along.
  const double layer_parameters =
      2.0 * 1024 * 2048 + 2.0 * 1024 * 1024 + 3.0 * 1024 * 3072 + 2 * 1024 + 2 * 128;
  const double attention = 2.0 * 2048 * 16 * 128;  // causal, at 2,048 tokens
  const double head = 2.0 * 1024 * 151936;
  const auto weights = d9d::model::pipeline_virtual_layers(small, 2048);
  EXPECT_NEAR(weights.head, head / (2 * layer_parameters + attention), 1e-12);
  EXPECT_NEAR(weights.head, 7.81, 0.01);
  EXPECT_EQ(weights.embedding, 0.5);
  // Two stages: 28 + 0.5 + 7.81 units, 18.15 each, so the first stage takes 18 layers.
  EXPECT_EQ(distribute_layers(28, 2, weights), (std::vector<LayerRange>{{0, 18}, {18, 28}}));
  // Without the sequence length the attention drops out and the head weighs more.
  EXPECT_NEAR(d9d::model::pipeline_virtual_layers(small, 0).head, head / (2 * layer_parameters),
              1e-12);
  EXPECT_THROW((void)d9d::model::pipeline_virtual_layers(small, -1), std::invalid_argument);

  // An 8B shape: the head weighs about three layers.
  d9d::model::Qwen3Config big;
  big.hidden_size = 4096;
  big.intermediate_size = 12288;
  big.num_hidden_layers = 36;
  big.num_attention_heads = 32;
  EXPECT_NEAR(d9d::model::pipeline_virtual_layers(big, 4096).head, 3.0, 0.25);

  // MoE: a layer counts its active experts (top 8 of 128 at 768) and its router.
  d9d::model::Qwen3MoeConfig moe;
  moe.hidden_size = 2048;
  moe.num_attention_heads = 32;
  moe.num_key_value_heads = 4;
  moe.num_hidden_layers = 48;
  const double moe_layer = 2.0 * 2048 * 4096 + 2.0 * 2048 * 512 + 8.0 * 3 * 2048 * 768 +
                           128.0 * 2048 + 2 * 2048 + 2 * 128;
  EXPECT_NEAR(d9d::model::pipeline_virtual_layers(moe, 4096).head,
              2.0 * 2048 * 151936 / (2 * moe_layer + 2.0 * 4096 * 32 * 128), 1e-12);
}

// Under a pipeline each stage pools the auxiliary loss over its own MoE layers, weighted by its
// share of the model's MoE layers: the gradient the loss adds, summed over every layer's router
// probabilities, is then the whole model's (here with layer 2 dense: 2 MoE layers on stage 0, 1 on
// stage 1; unweighted, the stages would add 2x the whole model's).
TEST(Pipeline_Qwen3MoeStage, AuxLossGradientOverTheStagesIsTheWholeModels) {
  d9d::model::Qwen3MoeConfig config;
  config.vocab_size = 64;
  config.hidden_size = 32;
  config.intermediate_size = 48;
  config.num_hidden_layers = 4;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 8;
  config.num_experts = 4;
  config.num_experts_per_tok = 2;
  config.moe_intermediate_size = 16;
  config.norm_topk_prob = true;
  config.mlp_only_layers = {2};
  config.router_aux_loss_coef = 0.05;
  config.output_router_logits = true;
  config.validate();
  torch::manual_seed(3);
  d9d::model::Qwen3MoeForCausalLM whole(config);
  const auto ids = at::randint(config.vocab_size, {2, 6}, at::kLong);
  (void)whole(ids);
  const auto whole_layers = d9d::model::moe_layers(*whole);
  ASSERT_EQ(whole_layers.size(), 3U);
  // Every layer of one pass shares the pass's statistics, so each gets the same gradient.
  const auto& first_layer = whole_layers.front();
  const auto expected = first_layer->last_stats()->aux_gradient(first_layer->layer_index()) * 3.0;
  ASSERT_GT(expected.abs().sum().item<double>(), 0.0);

  at::Tensor total;
  at::Tensor h = ids;
  const std::vector<LayerRange> ranges = {{0, 2}, {2, 4}};
  for (int s = 0; s < 2; ++s) {
    d9d::model::Qwen3MoeStage stage(config, s, 2, ranges[static_cast<std::size_t>(s)]);
    d9d::model::copy_parameters(*whole, *stage);
    h = stage(h);
    const auto layers = d9d::model::moe_layers(*stage);
    const auto part = layers.front()->last_stats()->aux_gradient(layers.front()->layer_index()) *
                      static_cast<double>(layers.size());
    total = total.defined() ? total + part : part;
  }
  EXPECT_TRUE(at::allclose(total, expected, 1e-5, 1e-9)) << total << " vs " << expected;
}

TEST(Pipeline_Qwen3Stage, StagesComposeToTheWholeModel) {
  const auto config = d9d::testing::pipeline_config();
  auto full = d9d::testing::reference_model();
  const auto ranges = distribute_layers(8, 3, {.embedding = 1, .head = 1});
  std::vector<d9d::model::Qwen3Stage> stages;
  std::size_t parameters = 0;
  for (int s = 0; s < 3; ++s) {
    stages.emplace_back(config, s, 3, ranges[static_cast<std::size_t>(s)]);
    d9d::model::copy_parameters(*full, *stages.back());
    parameters += stages.back()->parameters().size();
  }
  EXPECT_EQ(parameters, full->parameters().size());
  const auto ids = at::randint(config.vocab_size, {2, 5}, at::kLong);
  at::Tensor h = ids;
  for (auto& stage : stages) {
    EXPECT_EQ(stage->input_sizes(2, 5), h.sizes().vec());
    h = stage(h);
    EXPECT_EQ(stage->output_sizes(2, 5), h.sizes().vec());
  }
  EXPECT_TRUE(at::allclose(h, full(ids), 1e-6, 1e-6));
  EXPECT_TRUE(stages.back()->named_parameters().contains("lm_head.weight"));
  EXPECT_TRUE(stages.front()->named_parameters().contains("model.embed_tokens.weight"));
}

TEST(Pipeline_Qwen3Stage, StagesStartWithTheWholeModelsValues) {
  // Initialisation by name: after the same seed, each stage holds exactly the whole model's values
  // (no copy), whatever the split; another seed gives other values.
  const auto config = d9d::testing::pipeline_config();
  at::manual_seed(11);
  const d9d::model::Qwen3ForCausalLM full(config);
  const auto want = full->named_parameters();
  for (const int stages : {2, 3, 8}) {
    const auto ranges = distribute_layers(8, stages, {.embedding = 1, .head = 2});
    std::size_t seen = 0;
    for (int s = 0; s < stages; ++s) {
      at::manual_seed(11);
      const d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
      for (const auto& item : stage->named_parameters()) {
        ASSERT_NE(want.find(item.key()), nullptr) << item.key();
        EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << stages << " " << item.key();
        ++seen;
      }
    }
    EXPECT_EQ(seen, want.size()) << stages;
  }
  at::manual_seed(12);
  const d9d::model::Qwen3ForCausalLM other(config);
  EXPECT_FALSE(at::equal(other->named_parameters()["model.layers.3.mlp.up_proj.weight"],
                         want["model.layers.3.mlp.up_proj.weight"]));
  // Different parameters of one model differ (each has its own stream).
  EXPECT_FALSE(at::equal(want["model.layers.3.mlp.up_proj.weight"],
                         want["model.layers.3.mlp.gate_proj.weight"]));
}

// A tied head on a last stage that is not the first: the stage holds its own copy of the
// embedding under the embedding's name, with the first stage's values, and uses it as the head.
TEST(Pipeline_Qwen3Stage, TiedLastStageHoldsACopyOfTheEmbedding) {
  auto config = d9d::testing::pipeline_config();
  config.tie_word_embeddings = true;
  at::manual_seed(7);
  const d9d::model::Qwen3Stage first(config, 0, 2, LayerRange{0, 4});
  at::manual_seed(7);
  d9d::model::Qwen3Stage last(config, 1, 2, LayerRange{8, 8});  // the norm and the head only
  at::manual_seed(7);
  d9d::model::Qwen3ForCausalLM whole(config);
  const auto first_params = first->named_parameters();
  const auto last_params = last->named_parameters();
  ASSERT_NE(last_params.find("model.embed_tokens.weight"), nullptr);
  EXPECT_EQ(last_params.find("lm_head.weight"), nullptr);
  EXPECT_TRUE(at::equal(last_params["model.embed_tokens.weight"],
                        first_params["model.embed_tokens.weight"]));
  EXPECT_TRUE(
      at::equal(last_params["model.embed_tokens.weight"], whole->model->embed_tokens->weight));
  // The last stage's logits are those of the whole tied model's head on the same hidden states.
  const auto hidden = at::randn({2, 5, config.hidden_size});
  const auto want = at::linear(whole->model->norm(hidden), whole->model->embed_tokens->weight);
  EXPECT_TRUE(at::allclose(last(hidden), want, 1e-6, 1e-7));
}

TEST(Pipeline_Qwen3Stage, ErrorsNameTheFix) {
  auto config = d9d::testing::pipeline_config();
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::model::Qwen3Stage(config, 2, 2, LayerRange{0, 4});
              }),
              HasSubstr("is not one of 2 stages"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::model::Qwen3Stage(config, 0, 2, LayerRange{4, 9});
              }),
              HasSubstr("not within the 8 decoder layers"));
  d9d::model::Qwen3Stage small(config, 0, 1, LayerRange{0, 2});
  auto other = config;
  other.hidden_size = 8;
  other.head_dim = 2;
  d9d::model::Qwen3Stage wrong(other, 0, 1, LayerRange{0, 2});
  EXPECT_THAT(d9d::testing::error_of([&] { d9d::model::copy_parameters(*wrong, *small); }),
              HasSubstr("another shape"));
}

// pp = 1: all stages on one rank, handed over locally; every schedule, trainable and frozen.
TEST(Pipeline_Executor, EveryScheduleOnOneRankEqualsTheReference) {
  for (const bool frozen : {false, true}) {
    const int ran = d9d::testing::for_each_program(
        1, {1, 3, 4}, [&](const std::string& what, const d9d::pipeline::Program& program) {
          const auto reference = d9d::testing::reference_step(program.microbatches, frozen);
          const auto run = d9d::testing::pipeline_step(program, d9d::ProcessGroup(), 0, frozen);
          d9d::testing::expect_matches(run, reference, what + (frozen ? " frozen" : ""));
          ASSERT_EQ(run.result.losses.size(), static_cast<std::size_t>(program.microbatches));
        });
    EXPECT_GE(ran, 15);
  }
}

// With all stages on one rank there is no communication; the timeline and the options still hold.
TEST(Pipeline_Executor, TimelineHasOneEntryPerComputeActionInProgramOrder) {
  int ran = 0;
  for (const bool overlap : {true, false}) {
    ran += d9d::testing::for_each_program(
        1, {4}, [&](const std::string& what, const d9d::pipeline::Program& program) {
          const auto reference = d9d::testing::reference_step(program.microbatches, false);
          const auto run =
              d9d::testing::pipeline_step(program, d9d::ProcessGroup(), 0, false, at::kCPU, {},
                                          {.overlap_p2p = overlap, .record_timeline = true});
          d9d::testing::expect_matches(run, reference, what);
          d9d::testing::expect_timeline_of(run.timeline, program, 0, what);
          const auto gathered = d9d::pipeline::gather_timeline(d9d::ProcessGroup(), run.timeline);
          ASSERT_EQ(gathered.ranks.size(), 1U);
          EXPECT_DOUBLE_EQ(gathered.makespan, run.timeline.back().end);
          const auto svg = d9d::pipeline::planned_and_measured_svg(
              program, {{.title = "measured", .timeline = gathered}}, what);
          const int actions = static_cast<int>(run.timeline.size());
          EXPECT_EQ(d9d::testing::occurrences(svg, R"(class="action")"), 2 * actions) << what;
          EXPECT_EQ(d9d::testing::occurrences(svg, R"(data-panel="1" data-rank="0")"), actions)
              << what;
          EXPECT_THAT(svg, HasSubstr("measured:"));
          EXPECT_THAT(svg, HasSubstr("planned (the program at the measured mean costs):"));
        });
  }
  EXPECT_GE(ran, 10);
  // Without recording, nothing is recorded; record_timeline(true) switches it on.
  const auto program = d9d::pipeline::build_program<d9d::pipeline::GPipe<>>(1, 2);
  d9d::pipeline::Executor one(program, d9d::ProcessGroup(),
                              {{.index = 0, .forward = [](const at::Tensor& x) { return x * 2; }}},
                              nullptr);
  EXPECT_TRUE(one.options().overlap_p2p);
  const auto x = at::ones({2, 3}, at::kFloat).requires_grad_(true);
  const auto loss = [](const at::Tensor& out, int) { return out.sum(); };
  (void)one.run({x, x}, loss);
  EXPECT_TRUE(one.timeline().empty());
  one.record_timeline(true);
  (void)one.run({x, x}, loss);
  d9d::testing::expect_timeline_of(one.timeline(), program, 0, "GPipe m=2");
}

// overlap_pairs on one rank: every schedule equals the reference, trainable and frozen (the
// V-placed ones run pairs: a forward and the other stage's backward at once); in the timeline the
// two actions of a pair span the same interval, and everything else follows in program order.
TEST(Pipeline_Executor, OverlappedPairsOnOneRankEqualTheReference) {
  int paired = 0;
  for (const bool frozen : {false, true}) {
    const int ran = d9d::testing::for_each_program(
        1, {2, 3, 4}, [&](const std::string& what, const d9d::pipeline::Program& program) {
          const auto reference = d9d::testing::reference_step(program.microbatches, frozen);
          const auto run =
              d9d::testing::pipeline_step(program, d9d::ProcessGroup(), 0, frozen, at::kCPU, {},
                                          {.record_timeline = true, .overlap_pairs = true});
          d9d::testing::expect_matches(run, reference, what + " with pairs at once");
          const auto actions = d9d::testing::compute_actions(program, 0);
          ASSERT_EQ(run.timeline.size(), actions.size()) << what;
          double previous_end = 0;
          for (std::size_t i = 0; i < actions.size(); ++i) {
            const auto& slot = run.timeline[i];
            EXPECT_EQ(slot.action, actions[i]) << what << " entry " << i;
            EXPECT_LE(slot.start, slot.end) << what << " entry " << i;
            if (d9d::pipeline::pair_at(actions, i)) {
              const auto& second = run.timeline[i + 1];
              EXPECT_EQ(second.action, actions[i + 1]) << what << " entry " << i + 1;
              EXPECT_EQ(second.start, slot.start) << what << " entry " << i;
              EXPECT_EQ(second.end, slot.end) << what << " entry " << i;
              EXPECT_LE(previous_end, slot.start) << what << " entry " << i;
              previous_end = slot.end;
              ++i;
              paired += frozen ? 0 : 1;
              continue;
            }
            EXPECT_LE(previous_end, slot.start) << what << " entry " << i;
            previous_end = slot.end;
          }
        });
    EXPECT_GE(ran, 15);
  }
  EXPECT_GE(paired, 6);  // ZeroBubbleV and DualPipeV at m = 2, 3, 4 have some
}

// A pair really runs at once. DualPipeV on one rank (stages 0 and 1, m = 2) pairs 0F1 with 1I0:
// stage 0's second forward waits (up to 10 s) for a backward of stage 1 to begin, which only a
// concurrent backward can do, and that backward runs on another thread. Without overlap_pairs
// the wait times out. Gradients equal the sequential run's.
struct Rendezvous {
  std::promise<std::thread::id> backward_began;
  std::atomic<bool> signalled{false};
};

// Identity whose first backward tells the rendezvous that it has begun, and on which thread.
struct SignalBackward : torch::autograd::Function<SignalBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            int64_t rendezvous) {
    ctx->saved_data["r"] = rendezvous;
    return y.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the rendezvous outlives the step
    auto* r = reinterpret_cast<Rendezvous*>(ctx->saved_data["r"].toInt());
    if (!r->signalled.exchange(true)) {
      r->backward_began.set_value(std::this_thread::get_id());
    }
    return {grads[0], torch::autograd::Variable()};
  }
};

TEST(Pipeline_Executor, APairsBackwardRunsWhileItsForwardDoes) {
  const auto program = d9d::pipeline::build_program<d9d::pipeline::DualPipeV<>>(1, 2);
  const auto pairs = d9d::pipeline::group_pairs(program);
  std::string order;
  for (const auto& a : d9d::testing::compute_actions(pairs, 0)) {
    order += d9d::pipeline::to_string(a) + " ";
  }
  EXPECT_THAT(order, HasSubstr("0F1 1I0 "));
  const auto step = [&](bool overlap, std::chrono::milliseconds wait, bool* concurrent,
                        std::thread::id* backward_thread) {
    auto rendezvous = std::make_shared<Rendezvous>();
    auto began = rendezvous->backward_began.get_future();
    const auto w0 = at::full({3}, 0.5, at::kDouble).requires_grad_(true);
    const auto w1 = at::full({3}, -2.0, at::kDouble).requires_grad_(true);
    int stage0_calls = 0;
    const auto stage0 = [&, rendezvous](const at::Tensor& x) {
      if (++stage0_calls == 2) {  // 0F1, the forward paired with 1I0
        *concurrent = began.wait_for(wait) == std::future_status::ready;
        if (*concurrent) {
          *backward_thread = began.get();
        }
      }
      return x * w0;
    };
    const auto stage1 = [&, rendezvous](const at::Tensor& y) {
      return SignalBackward::apply(y, reinterpret_cast<int64_t>(rendezvous.get())) * w1;
    };
    d9d::pipeline::Executor executor(
        program, d9d::ProcessGroup(),
        {{.index = 0, .forward = stage0}, {.index = 1, .forward = stage1}}, nullptr,
        {.overlap_pairs = overlap});
    const auto x = at::arange(3, at::kDouble);
    (void)executor.run({x, x + 1}, [](const at::Tensor& out, int) { return out.sum(); });
    return std::make_pair(w0.grad().clone(), w1.grad().clone());
  };
  bool concurrent = false;
  std::thread::id backward_thread;
  const auto overlapped = step(true, std::chrono::seconds(10), &concurrent, &backward_thread);
  EXPECT_TRUE(concurrent) << "1I0 did not begin while 0F1 ran";
  EXPECT_NE(backward_thread, std::this_thread::get_id());
  bool sequential_concurrent = true;
  // In sequence 1I0 starts only after 0F1 has returned: a short wait shows it.
  const auto sequential =
      step(false, std::chrono::milliseconds(300), &sequential_concurrent, &backward_thread);
  EXPECT_FALSE(sequential_concurrent);
  EXPECT_TRUE(at::equal(overlapped.first, sequential.first));
  EXPECT_TRUE(at::equal(overlapped.second, sequential.second));
}

// On CUDA the timeline comes from events on the current stream, resolved by timeline(): still
// one entry per compute action, in program order, one after the other. Skips without a GPU.
TEST(Pipeline_Executor_Cuda, TimelineFromDeviceEvents) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  for (const auto& program : {d9d::pipeline::build_program<d9d::pipeline::OneFOneB<>>(1, 3),
                              d9d::pipeline::build_program<d9d::pipeline::ZeroBubbleV<>>(1, 3)}) {
    const auto run =
        d9d::testing::pipeline_step(program, d9d::ProcessGroup(), 0, false,
                                    c10::Device(at::kCUDA, 0), {}, {.record_timeline = true});
    d9d::testing::expect_matches(run, d9d::testing::reference_step(program.microbatches, false),
                                 "cuda");
    d9d::testing::expect_timeline_of(run.timeline, program, 0, "cuda");
    EXPECT_GT(run.timeline.back().end, 0.0);
  }
}

TEST(Pipeline_Executor, ErrorsAreClear) {
  const auto program = d9d::pipeline::build_program<d9d::pipeline::GPipe<>>(2, 2);
  const auto forward = [](const at::Tensor& x) { return x; };
  // Without the group, a two-rank program cannot run.
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::pipeline::Executor(program, d9d::ProcessGroup(),
                                        {{.index = 0, .forward = forward}}, nullptr);
              }),
              HasSubstr("needs the pipeline process group"));
  // A one-rank program with the wrong stages.
  const auto looped =
      d9d::pipeline::build_program<d9d::pipeline::LoopedBfs<d9d::pipeline::stages_per_rank<2>>>(1,
                                                                                                2);
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::pipeline::Executor(looped, d9d::ProcessGroup(),
                                        {{.index = 0, .forward = forward}}, nullptr);
              }),
              HasSubstr("must get exactly its stages {0, 1}"));
  // Too few inputs, and a loss that is not a scalar.
  d9d::pipeline::Executor one(d9d::pipeline::build_program<d9d::pipeline::GPipe<>>(1, 2),
                              d9d::ProcessGroup(), {{.index = 0, .forward = forward}}, nullptr);
  const auto x = at::ones({2, 3}, at::kFloat).requires_grad_(true);
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)one.run({x}, [](const at::Tensor& out, int) { return out.sum(); });
              }),
              HasSubstr("got 1 inputs; the program has 2 microbatches"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)one.run({x, x}, [](const at::Tensor& out, int) { return out * 2; });
              }),
              HasSubstr("is not a scalar but [2, 3]"));
  // The executor stays usable after a failed step.
  const auto result = one.run({x, x}, [](const at::Tensor& out, int) { return out.sum(); });
  ASSERT_EQ(result.losses.size(), 2U);
  EXPECT_DOUBLE_EQ(result.losses[1].item<double>(), 6.0);
}

}  // namespace
