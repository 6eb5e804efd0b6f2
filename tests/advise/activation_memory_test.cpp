// d9d::advise::qwen3_activation_bytes (d9d/advise/activation_memory.hpp) against the bytes
// Qwen3ForCausalLM::loss() leaves allocated for its backward (d9d::advise::CpuMemoryMeter), in
// float32, under bfloat16 autocast (as Bf16Mixed runs) and with bfloat16 parameters, for tied and
// untied heads, several widths, head counts, head sizes, depths, batches and sequence lengths, each
// term checked by varying one size at a time; per pipeline stage, under the recompute policies,
// with the step's weight casts, and per rank under tensor parallelism on 2 Gloo ranks.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/advise/memory_meter.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/d9d.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/peft/lora.hpp>

#include "tests/advise/all_threads_meter.hpp"
#include "tests/core/core_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::RankEnv;

struct Shape {
  int64_t hidden;
  int64_t intermediate;
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t layers;
  int64_t vocab;
  bool tied;
};

d9d::model::Qwen3Config config_of(const Shape& s) {
  return d9d::model::Qwen3Config::from_json_text(
      R"({"vocab_size": )" + std::to_string(s.vocab) + R"(, "hidden_size": )" +
      std::to_string(s.hidden) + R"(, "intermediate_size": )" + std::to_string(s.intermediate) +
      R"(, "num_hidden_layers": )" + std::to_string(s.layers) + R"(, "num_attention_heads": )" +
      std::to_string(s.heads) + R"(, "num_key_value_heads": )" + std::to_string(s.kv_heads) +
      R"(, "head_dim": )" + std::to_string(s.head_dim) +
      R"(, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": )" +
      (s.tied ? "true" : "false") + "}");
}

// The bytes the forward of one microbatch leaves allocated until its backward, its matmuls in
// `autocast` (bfloat16: under autocast, as the train step runs Bf16Mixed).
// With `peft`, the model adapted by it after the cast (as the parallelize layer casts the model
// before it adds the adapters).
int64_t measured(const d9d::model::Qwen3Config& config, int64_t batch, int64_t seq,
                 d9d::advise::Compute compute, const d9d::peft::StackSpec* peft = nullptr) {
  using d9d::advise::Compute;
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM model(config);
  if (compute == Compute::bf16_parameters) {
    model->to(at::kBFloat16);
  }
  if (peft != nullptr) {
    d9d::peft::apply_stack(*model, *peft);
  }
  const auto ids = torch::randint(config.vocab_size, {batch, seq}, torch::kLong);
  const auto labels = torch::randint(config.vocab_size, {batch, seq}, torch::kLong);
  d9d::advise::CpuMemoryMeter meter;
  at::Tensor loss;
  {
    const d9d::detail::AutocastScope scope(compute != Compute::float32, c10::DeviceType::CPU);
    loss = model->loss(ids, labels).loss_sum;
  }
  const int64_t kept = meter.live();
  loss.backward();  // the graph is used, as in training
  return kept;
}

// The 5-layer model the stage tests split into 2 stages, and its split at `seq` tokens.
d9d::model::Qwen3Config five_layers() {
  return config_of({.hidden = 64,
                    .intermediate = 160,
                    .heads = 4,
                    .kv_heads = 2,
                    .head_dim = 16,
                    .layers = 5,
                    .vocab = 96,
                    .tied = false});
}

std::vector<d9d::model::LayerRange> two_stages(const d9d::model::Qwen3Config& config, int64_t seq) {
  return d9d::model::distribute_layers(5, 2, d9d::model::pipeline_virtual_layers(config, seq));
}

TEST(Advise_ActivationMemory, PredictsWhatTheForwardKeeps) {
  ASSERT_TRUE(d9d::model::fused_kernels()) << "the prediction is of the fused kernels' default";
  const Shape base{.hidden = 64,
                   .intermediate = 160,
                   .heads = 4,
                   .kv_heads = 2,
                   .head_dim = 16,
                   .layers = 2,
                   .vocab = 96,
                   .tied = false};
  std::vector<Shape> shapes{base};
  auto wider = base;
  wider.hidden = 96;
  shapes.push_back(wider);
  auto mlp = base;
  mlp.intermediate = 224;
  shapes.push_back(mlp);
  auto heads = base;
  heads.heads = 8;
  heads.kv_heads = 8;  // no grouping
  shapes.push_back(heads);
  auto dim = base;
  dim.head_dim = 32;
  shapes.push_back(dim);
  auto deep = base;
  deep.layers = 3;
  shapes.push_back(deep);
  auto vocab = base;
  vocab.vocab = 200;
  vocab.tied = true;
  shapes.push_back(vocab);
  int checked = 0;
  using d9d::advise::Compute;
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    for (const auto& shape : shapes) {
      const auto config = config_of(shape);
      for (const auto& [batch, seq] : {std::pair<int64_t, int64_t>{1, 16}, {3, 16}, {2, 40}}) {
        const auto predicted =
            d9d::advise::qwen3_activation_bytes(config, batch, seq, compute).total();
        const auto kept = measured(config, batch, seq, compute);
        const auto what = "compute " + std::to_string(static_cast<int>(compute)) + ", hidden " +
                          std::to_string(shape.hidden) + ", intermediate " +
                          std::to_string(shape.intermediate) + ", heads " +
                          std::to_string(shape.heads) + "/" + std::to_string(shape.kv_heads) +
                          " x " + std::to_string(shape.head_dim) + ", layers " +
                          std::to_string(shape.layers) + ", vocab " + std::to_string(shape.vocab) +
                          ", batch " + std::to_string(batch) + " x " + std::to_string(seq);
        // Within 1% (the issue allows 10%); the difference seen is the loss's few scalars.
        EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(kept), 0.01 * kept) << what;
        EXPECT_LE(std::abs(predicted - kept), 64) << what;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 63);
}

// PEFT policies: FullTune's prediction plus qwen3_peft_activation_delta against the forward of
// the model d9d::peft::apply_stack adapted, for LoRA on every linear layer, LoRA on the seven
// projections by name with the embedding trained, and LoRA + Train<"*norm">, in the three ways of
// computing, tied and untied; and what is refused (LoRA on q alone: k, v, o and the MLP frozen
// without adapters).
TEST(Advise_ActivationMemory, PeftPoliciesPredictWhatTheForwardKeeps) {
  using d9d::advise::Compute;
  namespace peft = d9d::peft;
  const std::vector<peft::StackSpec> specs{
      peft::stack_spec<peft::Lora<4, 8>>(),
      peft::stack_spec<peft::Stack<peft::Lora<2, 4, "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj",
                                              "*.gate_proj", "*.up_proj", "*.down_proj">,
                                   peft::Train<"model.embed_tokens">>>(),
      peft::stack_spec<peft::Stack<peft::Lora<3, 6>, peft::Train<"*norm">>>()};
  int checked = 0;
  for (const bool tied : {false, true}) {
    const auto config = config_of({.hidden = 64,
                                   .intermediate = 160,
                                   .heads = 4,
                                   .kv_heads = 2,
                                   .head_dim = 16,
                                   .layers = 2,
                                   .vocab = 96,
                                   .tied = tied});
    for (const auto compute :
         {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
      for (const auto& spec : specs) {
        const auto parameters =
            d9d::advise::apply_peft(d9d::advise::qwen3_parameters(config), spec);
        for (const auto& [batch, seq] : {std::pair<int64_t, int64_t>{1, 16}, {2, 40}}) {
          const auto predicted =
              d9d::advise::qwen3_activation_bytes(config, batch, seq, compute).total() +
              d9d::advise::qwen3_peft_activation_delta(config, parameters, batch, seq, compute);
          const auto kept = measured(config, batch, seq, compute, &spec);
          const auto what = spec.methods.front().describe() + ", compute " +
                            std::to_string(static_cast<int>(compute)) +
                            (tied ? ", tied" : ", untied") + ", batch " + std::to_string(batch) +
                            " x " + std::to_string(seq);
          EXPECT_LE(std::abs(predicted - kept), 64)
              << what << ": predicted " << predicted << ", kept " << kept;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 36);
  const auto config = five_layers();
  const auto refused = [&](const peft::StackSpec& spec, bool dropout = false) {
    return d9d::testing::error_of([&] {
      (void)d9d::advise::qwen3_peft_activation_delta(
          config, d9d::advise::apply_peft(d9d::advise::qwen3_parameters(config), spec), 1, 16,
          Compute::float32, dropout);
    });
  };
  EXPECT_THAT(
      refused(peft::stack_spec<peft::Stack<peft::Lora<2, 4>, peft::Lora<2, 4, "lm_head">>>()),
      ::testing::HasSubstr("an adapter on the LM head"));
  EXPECT_THAT(refused(peft::stack_spec<peft::Freeze<"*.q_proj">>()),
              ::testing::HasSubstr("a frozen linear layer without an adapter"));
  EXPECT_THAT(refused(peft::stack_spec<peft::Lora<2, 4, "*.q_proj">>()),
              ::testing::HasSubstr("a frozen linear layer without an adapter"));
  EXPECT_THAT(refused(peft::stack_spec<peft::Lora<2, 4>>(), true),
              ::testing::HasSubstr("LoRA with dropout is not predicted yet"));
}

// Each pipeline stage's forward (and on the last the loss the pipelined step runs on its logits),
// measured alike: the received input is made before the meter, the embedding's output inside it.
TEST(Advise_ActivationMemory, StagesPredictWhatTheirForwardKeeps) {
  using d9d::advise::Compute;
  int checked = 0;
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    for (const auto& [hidden, vocab, tied] :
         {std::tuple<int64_t, int64_t, bool>{64, 96, false}, {96, 200, false}, {64, 96, true}}) {
      const auto config = config_of({.hidden = hidden,
                                     .intermediate = 160,
                                     .heads = 4,
                                     .kv_heads = 2,
                                     .head_dim = 16,
                                     .layers = 5,
                                     .vocab = vocab,
                                     .tied = tied});
      for (const int stages : {2, 3}) {
        constexpr int64_t kBatch = 2;
        constexpr int64_t kSeq = 16;
        const auto ranges = d9d::model::distribute_layers(
            5, stages, d9d::model::pipeline_virtual_layers(config, kSeq));
        for (int s = 0; s < stages; ++s) {
          torch::manual_seed(4);
          d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
          const auto dtype = compute == Compute::bf16_parameters ? at::kBFloat16 : at::kFloat;
          stage->to(dtype);
          const auto labels = torch::randint(vocab, {kBatch, kSeq}, torch::kLong);
          const auto input = s == 0 ? torch::randint(vocab, {kBatch, kSeq}, torch::kLong)
                                    : torch::randn({kBatch, kSeq, hidden}, dtype).requires_grad_();
          int64_t kept = 0;
          at::Tensor out;
          {
            d9d::advise::CpuMemoryMeter meter;
            {
              const d9d::detail::AutocastScope scope(compute != Compute::float32,
                                                     c10::DeviceType::CPU);
              out = stage(input);
              if (s == stages - 1) {
                out = d9d::model::logits_cross_entropy(out, labels).loss_sum;
              }
            }
            kept = meter.live();
          }
          const auto predicted =
              d9d::advise::qwen3_stage_activation_bytes(config, s, stages, kBatch, kSeq, compute);
          const int64_t expected = predicted.total() - (s == 0 ? 0 : predicted.input);
          EXPECT_LE(std::abs(expected - kept), 64)
              << "compute " << static_cast<int>(compute) << ", hidden " << hidden << ", vocab "
              << vocab << (tied ? " tied" : "") << ", stage " << s << " of " << stages
              << ": predicted " << expected << ", kept " << kept;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 45);
}

// The train step casts each weight once for all its microbatches
// (d9d/core/detail/weight_casts.hpp): two microbatches' forwards through a stage under bfloat16
// autocast keep two sets of activations but one set of weight casts
// (StageActivationBytes::weight_casts), as fullest_rank_memory counts them for a pipeline rank.
// Without the step's scope each forward casts its own.
TEST(Advise_ActivationMemory, TheStepCastsEachWeightOnceForItsMicrobatches) {
  using d9d::advise::Compute;
  const auto config = five_layers();
  constexpr int stages = 2;
  constexpr int64_t kBatch = 2;
  constexpr int64_t kSeq = 16;
  const auto ranges = two_stages(config, kSeq);
  for (const bool step : {true, false}) {
    for (int s = 0; s < stages; ++s) {
      torch::manual_seed(4);
      d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
      std::vector<at::Tensor> inputs;
      std::vector<at::Tensor> labels;
      for (int m = 0; m < 2; ++m) {
        labels.push_back(torch::randint(96, {kBatch, kSeq}, torch::kLong));
        inputs.push_back(s == 0 ? torch::randint(96, {kBatch, kSeq}, torch::kLong)
                                : torch::randn({kBatch, kSeq, 64}).requires_grad_());
      }
      int64_t kept = 0;
      {
        std::vector<at::Tensor> outs;
        d9d::advise::CpuMemoryMeter meter;
        {
          const d9d::detail::WeightCastScope casts(step);
          for (int m = 0; m < 2; ++m) {
            const d9d::detail::AutocastScope scope(true, c10::DeviceType::CPU);
            auto out = stage(inputs[static_cast<std::size_t>(m)]);
            if (s == stages - 1) {
              out = d9d::model::logits_cross_entropy(out, labels[static_cast<std::size_t>(m)])
                        .loss_sum;
            }
            outs.push_back(out);
          }
          kept = meter.live();
        }
      }
      const auto one = d9d::advise::qwen3_stage_activation_bytes(config, s, stages, kBatch, kSeq,
                                                                 Compute::bf16_autocast);
      ASSERT_GT(one.weight_casts, 0);
      const int64_t per_microbatch = one.total() - one.weight_casts - (s == 0 ? 0 : one.input);
      const int64_t expected = 2 * per_microbatch + (step ? 1 : 2) * one.weight_casts;
      // Within 128 bytes a microbatch: the loss's scalars.
      EXPECT_LE(std::abs(expected - kept), 256)
          << (step ? "in the step's scope" : "without it") << ", stage " << s << ": predicted "
          << expected << ", kept " << kept;
    }
  }
}

// Under a split backward each stage's I leaves what its queued weight gradients read (every linear
// layer's input and output gradient) until W: measured after I as the bytes still allocated, less
// the gradients I itself produced (the norms' and the embedding's weights, the received input's):
// within 64 bytes, in the three ways of computing, on both stages.
TEST(Advise_ActivationMemory, SplitBackwardKeepsWhatWReads) {
  using d9d::advise::Compute;
  int checked = 0;
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    const auto config = five_layers();
    constexpr int stages = 2;
    constexpr int64_t kBatch = 2;
    constexpr int64_t kSeq = 16;
    const auto ranges = two_stages(config, kSeq);
    for (int s = 0; s < stages; ++s) {
      torch::manual_seed(4);
      d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
      const auto dtype = compute == Compute::bf16_parameters ? at::kBFloat16 : at::kFloat;
      stage->to(dtype);
      const auto labels = torch::randint(96, {kBatch, kSeq}, torch::kLong);
      const auto input = s == 0 ? torch::randint(96, {kBatch, kSeq}, torch::kLong)
                                : torch::randn({kBatch, kSeq, 64}, dtype).requires_grad_();
      d9d::WeightGradQueue queue;
      int64_t left = 0;
      {
        d9d::advise::CpuMemoryMeter meter;
        {
          at::Tensor out;
          {
            const d9d::RecordWeightGrads record(queue);
            const d9d::detail::AutocastScope scope(compute != Compute::float32,
                                                   c10::DeviceType::CPU);
            out = stage(input);
            if (s == stages - 1) {
              out = d9d::model::logits_cross_entropy(out, labels).loss_sum;
            }
          }
          const d9d::DeferWeightGrads defer(queue);
          torch::autograd::backward({out}, {torch::ones_like(out)});
        }
        left = meter.live();
      }
      // What I produced and the test keeps: the non-linear parameters' gradients, the input's.
      int64_t produced = 0;
      for (const auto& p : stage->parameters()) {
        if (p.grad().defined()) {
          produced += p.grad().numel() * p.grad().element_size();
        }
      }
      if (s > 0) {
        produced += input.grad().numel() * input.grad().element_size();
      }
      const int64_t kept = left - produced;
      const int64_t predicted =
          d9d::advise::qwen3_stage_weight_gradient_bytes(config, s, stages, kBatch, kSeq, compute);
      EXPECT_LE(std::abs(predicted - kept), 64)
          << "compute " << static_cast<int>(compute) << ", stage " << s << ": predicted "
          << predicted << ", kept " << kept;
      queue.drain();
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6);
}

// Recomputed decoder layers (the recompute policies through parallelize, as the Trainer applies
// them): Full and EveryNth<2> keep only a recomputed layer's output, Attention<1> and
// Attention<2> a recomputed layer's MLP part and output; within 64 bytes in the three ways of
// computing, at 2 and 3 layers (EveryNth<2> and Attention<2> recompute the second layer only).
template <class Policy>
int64_t kept_under(const d9d::DeviceMesh& mesh, const d9d::model::Qwen3Config& config,
                   d9d::advise::Compute compute) {
  using d9d::advise::Compute;
  torch::manual_seed(5);
  d9d::model::Qwen3ForCausalLM model(config);
  // Bf16Params' parallelize stores the parameters in bfloat16; the others keep float32.
  const auto parallel =
      compute == Compute::bf16_parameters
          ? d9d::parallel::parallelize<d9d::Plan<Policy, d9d::precision::Bf16Params<>>>(
                mesh, {model.ptr()})
          : d9d::parallel::parallelize<d9d::Plan<Policy>>(mesh, {model.ptr()});
  EXPECT_EQ(model->lm_head->weight.scalar_type(),
            compute == Compute::bf16_parameters ? at::kBFloat16 : at::kFloat);
  const auto ids = torch::randint(96, {2, 16}, torch::kLong);
  int64_t kept = 0;
  at::Tensor loss;
  {
    d9d::advise::CpuMemoryMeter meter;
    {
      const d9d::detail::AutocastScope scope(compute != Compute::float32, c10::DeviceType::CPU);
      loss = model->loss(ids, ids).loss_sum;
    }
    kept = meter.live();
    loss.backward();
  }
  return kept;
}

TEST(Advise_ActivationMemory, RecomputedLayersKeepWhatTheirPolicyLeaves) {
  using d9d::advise::Compute;
  using d9d::advise::Recompute;
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  int checked = 0;
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    for (const int layers : {2, 3}) {
      const auto config = config_of({.hidden = 64,
                                     .intermediate = 160,
                                     .heads = 4,
                                     .kv_heads = 2,
                                     .head_dim = 16,
                                     .layers = layers,
                                     .vocab = 96,
                                     .tied = false});
      const auto none = d9d::advise::qwen3_activation_bytes(config, 2, 16, compute).total();
      const auto check = [&](int64_t kept, Recompute recompute, const char* policy) {
        const auto predicted =
            d9d::advise::qwen3_activation_bytes(config, 2, 16, compute, recompute).total();
        EXPECT_LE(std::abs(predicted - kept), 64)
            << policy << ", compute " << static_cast<int>(compute) << ", " << layers
            << " layers: predicted " << predicted << ", kept " << kept;
        EXPECT_LT(predicted, none) << policy;
        ++checked;
        return predicted;
      };
      const auto full =
          check(kept_under<d9d::recompute::Full>(mesh, config, compute), Recompute::full(), "Full");
      const auto every2 = check(kept_under<d9d::recompute::EveryNth<2>>(mesh, config, compute),
                                {.every_nth = 2}, "EveryNth<2>");
      const auto attention = check(kept_under<d9d::recompute::Attention<>>(mesh, config, compute),
                                   {.every_nth = 1, .attention_only = true}, "Attention<1>");
      check(kept_under<d9d::recompute::Attention<2>>(mesh, config, compute),
            {.every_nth = 2, .attention_only = true}, "Attention<2>");
      // Recomputing every whole layer keeps the least.
      EXPECT_LT(full, every2);
      EXPECT_LT(full, attention);
    }
  }
  EXPECT_EQ(checked, 24);
}

// Every layer of a stage recomputed, whole (Full) or its attention part (Attention<1>), through
// parallelize on the stage module as the Trainer applies it per rank: within 64 bytes of
// qwen3_stage_activation_bytes with the same Recompute, on both stages of 2, in the three ways
// of computing.
TEST(Advise_ActivationMemory, RecomputedStagesKeepWhatTheirPolicyLeaves) {
  using d9d::advise::Compute;
  using d9d::advise::Recompute;
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  const auto config = five_layers();
  constexpr int stages = 2;
  constexpr int64_t kBatch = 2;
  constexpr int64_t kSeq = 16;
  const auto ranges = two_stages(config, kSeq);
  int checked = 0;
  const auto measure = [&]<class Policy>(Compute compute, int s) {
    torch::manual_seed(4);
    d9d::model::Qwen3Stage stage(config, s, stages, ranges[static_cast<std::size_t>(s)]);
    const auto parallel =
        compute == Compute::bf16_parameters
            ? d9d::parallel::parallelize<d9d::Plan<Policy, d9d::precision::Bf16Params<>>>(
                  mesh, {stage.ptr()})
            : d9d::parallel::parallelize<d9d::Plan<Policy>>(mesh, {stage.ptr()});
    const auto dtype = compute == Compute::bf16_parameters ? at::kBFloat16 : at::kFloat;
    const auto labels = torch::randint(96, {kBatch, kSeq}, torch::kLong);
    const auto input = s == 0 ? torch::randint(96, {kBatch, kSeq}, torch::kLong)
                              : torch::randn({kBatch, kSeq, 64}, dtype).requires_grad_();
    int64_t kept = 0;
    at::Tensor out;
    {
      d9d::advise::CpuMemoryMeter meter;
      {
        const d9d::detail::AutocastScope scope(compute != Compute::float32, c10::DeviceType::CPU);
        out = stage(input);
        if (s == stages - 1) {
          out = d9d::model::logits_cross_entropy(out, labels).loss_sum;
        }
      }
      kept = meter.live();
    }
    return kept;
  };
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    for (int s = 0; s < stages; ++s) {
      for (const bool attention : {false, true}) {
        const int64_t kept =
            attention ? measure.template operator()<d9d::recompute::Attention<>>(compute, s)
                      : measure.template operator()<d9d::recompute::Full>(compute, s);
        const Recompute recompute{.every_nth = 1, .attention_only = attention};
        const auto predicted = d9d::advise::qwen3_stage_activation_bytes(config, s, stages, kBatch,
                                                                         kSeq, compute, recompute);
        const int64_t expected = predicted.total() - (s == 0 ? 0 : predicted.input);
        EXPECT_LE(std::abs(expected - kept), 64)
            << (attention ? "Attention<1>" : "Full") << ", compute " << static_cast<int>(compute)
            << ", stage " << s << ": predicted " << expected << ", kept " << kept;
        EXPECT_LT(predicted.total(), d9d::advise::qwen3_stage_activation_bytes(
                                         config, s, stages, kBatch, kSeq, compute)
                                         .total());
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 12);
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::advise::qwen3_stage_activation_bytes(config, 0, stages, kBatch, kSeq,
                                                                Compute::float32, {.every_nth = 2});
              }),
              testing::HasSubstr("every 2-th layer under a pipeline is not predicted"));
}

// A rank's peak: the forwards in flight on it, each at its stage's bytes.
TEST(Advise_ActivationMemory, APipelineRankHoldsItsMicrobatchesInFlight) {
  namespace pl = d9d::pipeline;
  const std::vector<int64_t> per_stage{10, 100};
  const auto one_f_one_b = pl::with_communication(pl::one_f_one_b(2, 4));
  EXPECT_EQ(d9d::advise::peak_rank_activation_bytes(one_f_one_b, 0, per_stage), 2 * 10);
  EXPECT_EQ(d9d::advise::peak_rank_activation_bytes(one_f_one_b, 1, per_stage), 1 * 100);
  const auto gpipe = pl::gpipe(2, 4);
  EXPECT_EQ(d9d::advise::peak_rank_activation_bytes(gpipe, 0, per_stage), 4 * 10);
  EXPECT_EQ(d9d::advise::peak_rank_activation_bytes(gpipe, 1, per_stage), 4 * 100);
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::advise::peak_rank_activation_bytes(gpipe, 2, per_stage); }),
              ::testing::HasSubstr("rank 2 of 2"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::advise::peak_rank_activation_bytes(gpipe, 0, {1, 2, 3});
              }),
              ::testing::HasSubstr("3 stage sizes for 2 stages"));
}

TEST(Advise_ActivationMemory, TheTermsAndTheirErrors) {
  const auto config = config_of({.hidden = 64,
                                 .intermediate = 160,
                                 .heads = 4,
                                 .kv_heads = 2,
                                 .head_dim = 16,
                                 .layers = 2,
                                 .vocab = 96,
                                 .tied = false});
  const auto one = d9d::advise::qwen3_activation_bytes(config, 1, 16);
  const auto two = d9d::advise::qwen3_activation_bytes(config, 2, 16);
  EXPECT_EQ(two.layers, 2 * one.layers) << "layers: per token";
  EXPECT_EQ(two.rope, one.rope) << "the rotary tables: per sequence length";
  EXPECT_EQ(two.loss - one.loss, (2 * 64 + 1) * 16 * 4) << "per token: embedding, rstd, dh";
  EXPECT_EQ(one.total(), one.layers + one.loss + one.rope);
  EXPECT_THAT(
      d9d::testing::error_of([&] { (void)d9d::advise::qwen3_activation_bytes(config, 0, 16); }),
      ::testing::HasSubstr("must be at least 1, got 0 and 16"));
  // Under bfloat16 autocast: per layer the weight matrices' bfloat16 casts, whatever the batch
  // (the q/k norms read their float32 weights as they are).
  using d9d::advise::Compute;
  const auto bf16_one = d9d::advise::qwen3_activation_bytes(config, 1, 16, Compute::bf16_autocast);
  const auto bf16_two = d9d::advise::qwen3_activation_bytes(config, 2, 16, Compute::bf16_autocast);
  const int64_t casts = int64_t{2} * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160) * 2;
  EXPECT_EQ(2 * bf16_one.layers - bf16_two.layers, casts);
  // With bfloat16 parameters nothing is cast: the layers' bytes are per token only.
  const auto params_one =
      d9d::advise::qwen3_activation_bytes(config, 1, 16, Compute::bf16_parameters);
  const auto params_two =
      d9d::advise::qwen3_activation_bytes(config, 2, 16, Compute::bf16_parameters);
  EXPECT_EQ(params_two.layers, 2 * params_one.layers);
  EXPECT_LT(params_one.total(), bf16_one.total());
}

// What `model`'s loss() on `ids` leaves allocated for its backward on every thread of this
// process, its forward computing as `compute` says (then the backward runs, as in training).
template <class Model>
int64_t kept_on_every_thread(const d9d::DeviceMesh& mesh, Model& model, const at::Tensor& ids,
                             d9d::advise::Compute compute) {
  int64_t kept = 0;
  at::Tensor loss;
  d9d::testing::AllThreadsCpuMeter meter;
  {
    const d9d::detail::AutocastScope scope(compute != d9d::advise::Compute::float32,
                                           c10::DeviceType::CPU);
    loss = model->loss(ids, ids).loss_sum;
  }
  // The collectives' worker threads drop their works' last references to the forward's buffers
  // some time after the work completes: read once the count has settled (unchanged for 100 ms,
  // at most 5 s).
  mesh.context().barrier();
  kept = meter.live();
  for (int still = 0, tries = 0; still < 5 && tries < 250; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int64_t now = meter.live();
    still = now == kept ? still + 1 : 0;
    kept = now;
  }
  loss.backward();
  return kept;
}

// Tensor parallelism over 2 Gloo ranks (as parallelize applies it, with and without sequence
// parallelism): each rank's forward keeps qwen3_activation_bytes(..., {.ranks = 2, ...}) in the
// three ways of computing, over widths, MLP widths, head counts, KV heads, head sizes, depths,
// vocabularies, tied heads and sequence lengths, and under Full and Attention<> recompute.
// Measured on every thread (d9d::testing::AllThreadsCpuMeter): the collectives' worker threads
// free some of the forward's buffers. Within 1,024 bytes (Gloo's small transient buffers, at
// most 516 bytes in the runs so far).
template <class... Slots>
int64_t tp_kept(const d9d::DeviceMesh& mesh, const d9d::model::Qwen3Config& config,
                d9d::advise::Compute compute, int64_t seq) {
  using d9d::advise::Compute;
  using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;
  torch::manual_seed(5);
  d9d::model::Qwen3ForCausalLM model(config);
  const auto parallel =
      compute == Compute::bf16_parameters
          ? d9d::parallel::parallelize<d9d::Plan<TpMesh, Slots..., d9d::precision::Bf16Params<>>>(
                mesh, {model.ptr()})
          : d9d::parallel::parallelize<d9d::Plan<TpMesh, Slots...>>(mesh, {model.ptr()});
  const auto ids = torch::randint(config.vocab_size, {2, seq}, torch::kLong);
  return kept_on_every_thread(mesh, model, ids, compute);
}

TEST(Advise_ActivationMemory_ws2, TensorParallelRanksKeepTheirSlices) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    using d9d::advise::Compute;
    using d9d::advise::Recompute;
    using Tp = d9d::parallel::TensorParallel<>;
    using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.tp = 2});
    int checked = 0;
    const auto check = [&](int64_t kept, const d9d::model::Qwen3Config& config, Compute compute,
                           int64_t seq, bool sp, Recompute recompute) {
      const auto predicted = d9d::advise::qwen3_activation_bytes(
          config, 2, seq, compute, recompute, {.ranks = 2, .sequence_parallel = sp});
      EXPECT_LE(std::abs(predicted.total() - kept), 1024)
          << "rank " << env.rank() << ", compute " << static_cast<int>(compute)
          << (sp ? ", sequence parallel" : "") << ", recompute every " << recompute.every_nth
          << (recompute.attention_only ? " (attention)" : "") << ", hidden " << config.hidden_size
          << ", layers " << config.num_hidden_layers << ", seq " << seq << ": predicted "
          << predicted.total() << ", kept " << kept;
      ++checked;
    };
    for (const auto compute :
         {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
      for (const auto& shape : std::vector<Shape>{{64, 160, 4, 2, 16, 2, 96, false},
                                                  {96, 192, 4, 2, 16, 3, 96, false},
                                                  {64, 160, 8, 4, 32, 2, 192, false},
                                                  {64, 160, 4, 2, 16, 2, 96, true}}) {
        const auto config = config_of(shape);
        for (const int64_t seq : {16, 32}) {
          check(tp_kept<Tp>(mesh, config, compute, seq), config, compute, seq, false, {});
          check(tp_kept<TpSp>(mesh, config, compute, seq), config, compute, seq, true, {});
        }
      }
      const auto config = config_of({64, 160, 4, 2, 16, 3, 96, false});
      check(tp_kept<TpSp, d9d::recompute::Full>(mesh, config, compute, 16), config, compute, 16,
            true, Recompute::full());
      check(tp_kept<Tp, d9d::recompute::Attention<>>(mesh, config, compute, 16), config, compute,
            16, false, {.every_nth = 1, .attention_only = true});
      check(tp_kept<TpSp, d9d::recompute::Attention<2>>(mesh, config, compute, 16), config, compute,
            16, true, {.every_nth = 2, .attention_only = true});
    }
    EXPECT_EQ(checked, 3 * (4 * 2 * 2 + 3));
  });
}

}  // namespace

namespace {

// A Qwen3-MoE of 4 heads (2 KV heads) of 16 and a dense MLP of 160 (for mlp_only_layers), with the
// sizes the MoE prediction's terms depend on.
struct MoeShape {
  int64_t hidden = 64;
  int64_t moe = 32;
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t layers = 2;
  int64_t shared = 0;
  bool sequence_aux = false;
  double bias_rate = 0.0;
  std::string dense_layers = "[]";
};

d9d::model::Qwen3MoeConfig moe_config_of(const MoeShape& s) {
  return d9d::model::Qwen3MoeConfig::from_json_text(
      R"({"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": )" +
      std::to_string(s.hidden) + R"(, "intermediate_size": 160, "num_hidden_layers": )" +
      std::to_string(s.layers) +
      R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
      "num_experts": )" +
      std::to_string(s.experts) + R"(, "num_experts_per_tok": )" + std::to_string(s.top_k) +
      R"(, "moe_intermediate_size": )" + std::to_string(s.moe) +
      R"(, "norm_topk_prob": true, "router_aux_loss_coef": 0.05, "output_router_logits": true,
      "router_bias_update_rate": )" +
      std::to_string(s.bias_rate) + R"(, "shared_expert_intermediate_size": )" +
      std::to_string(s.shared) + R"(, "mlp_only_layers": )" + s.dense_layers +
      R"(, "router_aux_loss_type": ")" + (s.sequence_aux ? "sequence" : "global_batch") + "\"}");
}

// What the MoE model's loss() leaves allocated for its backward on this thread.
int64_t moe_kept(d9d::model::Qwen3MoeForCausalLM& model, int64_t batch, int64_t seq,
                 d9d::advise::Compute compute) {
  using d9d::advise::Compute;
  const auto ids = torch::randint(model->config().vocab_size, {batch, seq}, torch::kLong);
  d9d::advise::CpuMemoryMeter meter;
  at::Tensor loss;
  {
    const d9d::detail::AutocastScope scope(compute != Compute::float32, c10::DeviceType::CPU);
    loss = model->loss(ids, ids).loss_sum;
  }
  const int64_t kept = meter.live();
  loss.backward();
  return kept;
}

TEST(Advise_ActivationMemory, MoeLayersPredictWhatTheirForwardKeeps) {
  using d9d::advise::Compute;
  const MoeShape base;
  const std::vector<MoeShape> shapes{base,
                                     {.hidden = 96},
                                     {.moe = 48},
                                     {.experts = 16},
                                     {.top_k = 3},
                                     {.layers = 3, .dense_layers = "[1]"},
                                     {.shared = 40},
                                     {.sequence_aux = true},
                                     {.bias_rate = 0.01}};
  int checked = 0;
  for (const auto compute : {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
    for (const auto& s : shapes) {
      const auto config = moe_config_of(s);
      for (const auto& [batch, seq] : {std::pair<int64_t, int64_t>{1, 16}, {2, 16}, {1, 40}}) {
        torch::manual_seed(3);
        d9d::model::Qwen3MoeForCausalLM model(config);
        if (compute == Compute::bf16_parameters) {
          model->to(at::kBFloat16);
        }
        const auto kept = moe_kept(model, batch, seq, compute);
        const auto predicted =
            d9d::advise::qwen3_moe_activation_bytes(config, batch, seq, compute).total();
        EXPECT_LE(std::abs(predicted - kept), 64)
            << "compute " << static_cast<int>(compute) << ", hidden " << s.hidden << ", moe "
            << s.moe << ", experts " << s.experts << ", top " << s.top_k << ", layers " << s.layers
            << " (dense " << s.dense_layers << "), shared " << s.shared
            << (s.sequence_aux ? ", sequence aux" : "") << ", bias " << s.bias_rate << ", batch "
            << batch << " x " << seq << ": predicted " << predicted << ", kept " << kept;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 3 * 9 * 3);
  // FullyShard in bf16 mixed with the experts outside its units: bfloat16 parameters but float32
  // experts, cast to bfloat16 as each layer runs and the casts kept for its backward.
  for (const auto& s : {base, MoeShape{.experts = 16}}) {
    const auto config = moe_config_of(s);
    torch::manual_seed(3);
    d9d::model::Qwen3MoeForCausalLM model(config);
    model->to(at::kBFloat16);
    for (auto& p : model->named_parameters()) {
      if (p.key().find("mlp.experts.") != std::string::npos) {
        p.value().set_data(p.value().detach().to(at::kFloat));
      }
    }
    const auto kept = moe_kept(model, 2, 16, Compute::bf16_parameters);
    const auto predicted = d9d::advise::qwen3_moe_activation_bytes(
        config, 2, 16, Compute::bf16_parameters, {.float32_experts = true});
    EXPECT_LE(std::abs(predicted.total() - kept), 64)
        << "experts " << s.experts << ": predicted " << predicted.total() << ", kept " << kept;
    // 2 layers x the casts of 3 x experts x moe x hidden bfloat16 weights.
    EXPECT_EQ(predicted.total() -
                  d9d::advise::qwen3_moe_activation_bytes(config, 2, 16, Compute::bf16_parameters)
                      .total(),
              int64_t{2} * 3 * s.experts * s.moe * s.hidden * 2);
  }
  // The terms: the experts' rows scale with the load; refused inputs name themselves.
  const auto config = moe_config_of(base);
  const auto balanced = d9d::advise::qwen3_moe_activation_bytes(config, 1, 16, Compute::float32,
                                                                {.ranks = 2, .load = 1.0});
  const auto doubled = d9d::advise::qwen3_moe_activation_bytes(config, 1, 16, Compute::float32,
                                                               {.ranks = 2, .load = 2.0});
  // 2 layers x 16 tokens x top 2 more rows, each its input, gate, up, silu, product and orders.
  EXPECT_EQ(doubled.total() - balanced.total(), 2 * 16 * 2 * ((64 + 4 * 32) * 4 + 16));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::advise::qwen3_moe_activation_bytes(config, 1, 16, Compute::float32,
                                                              {.ranks = 3});
              }),
              ::testing::HasSubstr("8 experts over 3 expert rank(s)"));
  auto dropping = config;
  dropping.moe_capacity_factor = 1.25;
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::advise::qwen3_moe_activation_bytes(dropping, 1, 16); }),
              ::testing::HasSubstr("token dropping"));
}

// Expert parallelism over 2 Gloo ranks (parallelize with ExpertParallel<>): each rank's forward
// keeps qwen3_moe_activation_bytes(..., {.ranks = 2, .load = L}) with the rows its experts get.
// The routing is made known: the routers' bias picks two experts for every token, both on rank 0
// (rank 0 runs every rank's rows: load 2, rank 1 none) or one on each rank (load 1 on both).
TEST(Advise_ActivationMemory_ws2, ExpertParallelRanksKeepTheirExpertsRows) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    using d9d::advise::Compute;
    using EpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    const auto ctx = d9d::testing::rank_context(env);
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.dp_replicate = 2, .ep = 2});
    MoeShape shape;
    shape.bias_rate = 0.01;
    const auto config = moe_config_of(shape);
    int checked = 0;
    for (const auto compute :
         {Compute::float32, Compute::bf16_autocast, Compute::bf16_parameters}) {
      for (const bool both_on_rank0 : {true, false}) {
        torch::manual_seed(7);
        d9d::model::Qwen3MoeForCausalLM model(config);
        if (compute == Compute::bf16_parameters) {
          model->to(at::kBFloat16);
        }
        {
          const at::NoGradGuard no_grad;
          for (auto& buffer : model->named_buffers()) {
            if (buffer.key().find("expert_bias") != std::string::npos) {
              auto bias = buffer.value();
              bias.zero_();
              bias[0] = 100.0;
              bias[both_on_rank0 ? 1 : 4] = 100.0;  // experts 0-3 on rank 0, 4-7 on rank 1
            }
          }
        }
        using Ep = d9d::parallel::ExpertParallel<>;
        const auto parallel =
            compute == Compute::bf16_parameters
                ? d9d::parallel::parallelize<d9d::Plan<EpMesh, Ep, d9d::precision::Bf16Params<>>>(
                      mesh, {model.ptr()})
                : d9d::parallel::parallelize<d9d::Plan<EpMesh, Ep>>(mesh, {model.ptr()});
        const auto ids = torch::randint(config.vocab_size, {2, 16}, torch::kLong);
        const int64_t kept = kept_on_every_thread(mesh, model, ids, compute);
        const double load = both_on_rank0 ? (env.rank() == 0 ? 2.0 : 0.0) : 1.0;
        const auto predicted = d9d::advise::qwen3_moe_activation_bytes(config, 2, 16, compute,
                                                                       {.ranks = 2, .load = load});
        EXPECT_LE(std::abs(predicted.total() - kept), 1024)
            << "rank " << env.rank() << ", compute " << static_cast<int>(compute) << ", load "
            << load << ": predicted " << predicted.total() << ", kept " << kept;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 6);
  });
}

}  // namespace
