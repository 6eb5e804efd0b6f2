// PEFT in one process (include/d9d/peft): the policies' facts, patterns, LoRA's forward against
// the merged model, exact unmerge, where gradients go, training with Trainer<Plan<peft::...>>,
// gradient memory, adapter files written and read back, the merged export, LoRA on grouped
// experts against its definition (and in peft's per-expert file layout), and the start-up errors.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/function.h>

#include <d9d/core/weight_grad.hpp>
#include <d9d/d9d.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/state/safetensors.hpp>

#include "tests/support/error_of.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::tiny_qwen3_json;
using d9d::testing::tiny_run;
using ::testing::HasSubstr;

namespace peft = d9d::peft;

// ---- the policies (compile time) -----------------------------------------------------------

using QvLora = peft::Lora<4, 8, "*.q_proj", "*.v_proj">;
static_assert(QvLora::rank == 4 && QvLora::alpha == 8 && QvLora::dropout_percent == 0);
static_assert(QvLora::targets.size() == 2 && QvLora::targets[1] == "*.v_proj");
static_assert(QvLora::with_dropout<5>::dropout_percent == 5);
static_assert(std::is_same_v<d9d::Plan<QvLora>::peft, QvLora>);
static_assert(d9d::peft_method<QvLora> && d9d::peft_method<peft::FullTune>);
static_assert(!d9d::peft_method<d9d::parallel::Fsdp> && !d9d::peft_method<int>);
using LoraAndNorms = peft::Stack<QvLora, peft::Train<"*norm">>;
static_assert(!LoraAndNorms::rest_trains && LoraAndNorms::size == 2);
static_assert(peft::Stack<peft::Lora<4, 8>, peft::FullTune>::rest_trains);
static_assert(peft::Stack<peft::Freeze<"model.embed_tokens">>::rest_trains);

TEST(Peft_Policies, StackSpecDescribesThePolicy) {
  const auto spec = peft::stack_spec<LoraAndNorms>();
  ASSERT_EQ(spec.methods.size(), 2U);
  EXPECT_EQ(spec.methods[0].kind, peft::MethodKind::lora);
  EXPECT_EQ(spec.methods[0].rank, 4);
  EXPECT_EQ(spec.methods[0].patterns, (std::vector<std::string>{"*.q_proj", "*.v_proj"}));
  EXPECT_EQ(spec.methods[0].describe(), R"(d9d::peft::Lora<4, 8, "*.q_proj", "*.v_proj">)");
  EXPECT_EQ(spec.methods[1].describe(), R"(d9d::peft::Train<"*norm">)");
  EXPECT_FALSE(spec.rest_trains);
  EXPECT_TRUE(peft::stack_spec<peft::FullTune>().rest_trains);
  EXPECT_FALSE(peft::stack_spec<QvLora>().rest_trains);
  EXPECT_DOUBLE_EQ(peft::stack_spec<QvLora::with_dropout<10>>().methods[0].dropout, 0.1);
}

TEST(Peft_Patterns, SuffixWithoutStarGlobWithStar) {
  EXPECT_TRUE(peft::pattern_matches("q_proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(
      peft::pattern_matches("layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(
      peft::pattern_matches("layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj"));
  EXPECT_FALSE(peft::pattern_matches("proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(peft::pattern_matches("lm_head", "lm_head"));
  EXPECT_TRUE(peft::pattern_matches("*.q_proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft::pattern_matches("*.q_proj", "q_proj"));
  EXPECT_TRUE(peft::pattern_matches("*norm", "model.layers.1.input_layernorm"));
  EXPECT_TRUE(peft::pattern_matches("model.layers.1*", "model.layers.1.mlp.up_proj"));
  EXPECT_TRUE(peft::pattern_matches("model.layers.1*", "model.layers.12"));
  EXPECT_FALSE(peft::pattern_matches("model.layers.1.*", "model.layers.12.mlp"));
  EXPECT_TRUE(peft::pattern_matches("*", "anything.at.all"));
}

// ---- LoRA on a model ---------------------------------------------------------------------------

d9d::model::Qwen3ForCausalLM tiny_model(bool tied = false) {
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(tiny_qwen3_json(tied)));
  model->to(at::kDouble);
  return model;
}

at::Tensor tokens() {
  auto generator = at::detail::createCPUGenerator(11);
  return at::randint(64, {2, 12}, generator, at::kLong);
}

// Non-zero B (a fresh adapter's B is zero, which would make every comparison trivial).
void randomize_adapters(torch::nn::Module& model) {
  const at::NoGradGuard no_grad;
  auto generator = at::detail::createCPUGenerator(17);
  for (const auto& layer : peft::lora_layers(model)) {
    (layer.expert_adapter != nullptr ? layer.expert_adapter->lora_B : layer.adapter->lora_B->weight)
        .normal_(0.0, 0.1, generator);
  }
}

std::map<std::string, at::Tensor> snapshot(const torch::nn::Module& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters()) {
    out[item.key()] = item.value().detach().clone();
  }
  return out;
}

TEST(Peft_Lora_r4, AddsPeftNamedParametersAndFreezesTheBase) {
  auto model = tiny_model();
  const auto base = d9d::peft::count_parameters(*model);
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  int adapters = 0;
  for (const auto& item : model->named_parameters()) {
    const bool lora = item.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(item.value().requires_grad(), lora) << item.key();
    adapters += lora ? 1 : 0;
  }
  EXPECT_EQ(adapters, 2 * 2 * 2);  // (A, B) x (q, v) x 2 layers
  // Copies: named_parameters() returns its dictionary by value (a reference into it dangles).
  const auto parameters = model->named_parameters();
  const auto a = parameters["model.layers.1.self_attn.q_proj.lora_A.weight"];
  const auto b = parameters["model.layers.1.self_attn.v_proj.lora_B.weight"];
  EXPECT_EQ(a.sizes(), (c10::IntArrayRef{4, 32}));
  EXPECT_EQ(b.sizes(), (c10::IntArrayRef{16, 4}));  // 2 KV heads x head_dim 8
  EXPECT_EQ(a.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::equal(b, at::zeros_like(b))) << "B starts at zero, as in peft";
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(32.0));
  const auto count = peft::count_parameters(*model);
  EXPECT_EQ(count.trainable, 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4));
  EXPECT_EQ(count.total, base.total + count.trainable);
  EXPECT_GT(count.trainable_percent(), 0.0);
  EXPECT_LT(count.trainable_percent(), 10.0);
}

TEST(Peft_Lora_r4, InitialValuesDependOnSeedAndNameOnly) {
  auto one = tiny_model();
  auto two = tiny_model();
  (void)torch::randn({100});  // the global generator's state must not matter
  peft::apply_stack(*one, peft::stack_spec<QvLora>(), 7);
  peft::apply_stack(*two, peft::stack_spec<QvLora>(), 7);
  auto three = tiny_model();
  peft::apply_stack(*three, peft::stack_spec<QvLora>(), 8);
  const auto name = "model.layers.0.self_attn.q_proj.lora_A.weight";
  EXPECT_TRUE(at::equal(one->named_parameters()[name], two->named_parameters()[name]));
  EXPECT_FALSE(at::equal(one->named_parameters()[name], three->named_parameters()[name]));
}

TEST(Peft_Lora_r4, ForwardEqualsTheMergedModelsAndUnmergeRestoresExactly) {
  auto model = tiny_model();
  model->eval();
  const auto ids = tokens();
  const auto plain = model(ids).detach();
  peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8>>());  // every linear but lm_head
  EXPECT_EQ(peft::lora_layers(*model).size(), 2U * 7U);
  EXPECT_TRUE(at::equal(model(ids), plain)) << "a fresh adapter (B = 0) changes nothing";
  randomize_adapters(*model);
  const auto before = snapshot(*model);
  const auto lora = model(ids).detach();
  EXPECT_GT((lora - plain).abs().max().item<double>(), 1e-3) << "the adapters act";

  peft::merge(*model);
  const auto q = "model.layers.0.self_attn.q_proj.weight";
  EXPECT_FALSE(at::equal(model->named_parameters()[q], before.at(q))) << "merge changed W";
  const auto merged = model(ids).detach();
  EXPECT_TRUE(at::allclose(merged, lora, 0.0, 1e-12))
      << "max diff " << (merged - lora).abs().max().item<double>();
  peft::merge(*model);  // merging twice changes nothing
  EXPECT_TRUE(at::equal(model(ids), merged));

  peft::unmerge(*model);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), before.at(item.key()))) << item.key();
  }
  EXPECT_TRUE(at::equal(model(ids), lora));
}

TEST(Peft_Lora_r4, MergeEqualsWPlusScaledBA) {
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  randomize_adapters(*model);
  const auto layers = peft::lora_layers(*model);
  const auto& first = layers.front();
  const auto w = first.layer->weight.detach().clone();
  const auto a = first.adapter->lora_A->weight.detach();
  const auto b = first.adapter->lora_B->weight.detach();
  EXPECT_DOUBLE_EQ(first.adapter->options().scale(), 2.0);  // alpha 8 / rank 4
  peft::merge(*model);
  EXPECT_TRUE(at::allclose(first.layer->weight, w + 2.0 * b.mm(a), 0.0, 1e-15));
  EXPECT_TRUE(first.adapter->merged());
  peft::unmerge(*model);
  EXPECT_TRUE(at::equal(first.layer->weight, w));
}

// Gradients reach the adapters and what the stack trains, nothing else.
void expect_gradients_only_on(const torch::nn::Module& model,
                              const std::function<bool(const std::string&)>& trains) {
  for (const auto& item : model.named_parameters()) {
    EXPECT_EQ(item.value().grad().defined(), trains(item.key())) << item.key();
  }
}

TEST(Peft_Lora_r4, GradientsOnlyOnTheAdapters) {
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  randomize_adapters(*model);
  model(tokens()).pow(2).mean().backward();
  expect_gradients_only_on(
      *model, [](const std::string& name) { return name.find(".lora_") != std::string::npos; });
}

// An adapted down projection under the fused kernels is one autograd node that recomputes
// silu(gate) * up in backward instead of keeping it. Its output and the gradients of the input and
// of every weight equal the fused kernels off (the layer over at::silu(gate) * up, its adapter's
// own layers) in float64, at once and deferred to a WeightGradQueue, with the down projection's
// weight trained and frozen.
TEST(Peft_Lora_r4, AnAdaptedDownProjectionEqualsTheCompositionAndRecomputesItsInput) {
  struct Run {
    std::string node;
    std::vector<at::Tensor> tensors;  // the output, x's gradient, every parameter's
  };
  const auto run = [](bool fused, bool frozen, bool deferred) {
    torch::manual_seed(3);
    d9d::model::SwiGlu mlp(12, 20);
    mlp->to(at::kDouble);
    peft::apply_stack(*mlp, peft::stack_spec<peft::Lora<3, 6, "down_proj">>());
    randomize_adapters(*mlp);
    mlp->gate_proj->weight.requires_grad_(true);
    mlp->up_proj->weight.requires_grad_(true);
    mlp->down_proj->weight.requires_grad_(!frozen);
    torch::manual_seed(4);
    const auto x = at::randn({2, 5, 12}, at::kDouble).requires_grad_();
    const auto grad_out = at::randn({2, 5, 12}, at::kDouble);
    d9d::model::set_fused_kernels(fused);
    d9d::WeightGradQueue queue;
    at::Tensor out;
    {
      const d9d::RecordWeightGrads record(queue);
      out = mlp(x);
    }
    {
      const d9d::DeferWeightGrads defer(queue);
      if (deferred) {
        out.backward(grad_out);
      }
    }
    if (deferred) {
      queue.drain();
    } else {
      out.backward(grad_out);
    }
    d9d::model::set_fused_kernels(true);
    Run r{.node = out.grad_fn()->name(), .tensors = {out.detach(), x.grad()}};
    for (const auto& item : mlp->named_parameters()) {
      r.tensors.push_back(item.value().grad());
    }
    return r;
  };
  for (const bool frozen : {false, true}) {
    const auto want = run(false, frozen, false);
    for (const bool deferred : {false, true}) {
      const auto got = run(true, frozen, deferred);
      EXPECT_THAT(got.node, HasSubstr("SiluMulLowRankLinear"));
      ASSERT_EQ(got.tensors.size(), want.tensors.size());
      for (std::size_t i = 0; i < got.tensors.size(); ++i) {
        const auto what = "tensor " + std::to_string(i) + (frozen ? ", W frozen" : ", W trained") +
                          (deferred ? ", deferred" : "");
        ASSERT_EQ(got.tensors[i].defined(), want.tensors[i].defined()) << what;
        if (want.tensors[i].defined()) {
          EXPECT_TRUE(at::allclose(got.tensors[i], want.tensors[i], 1e-12, 1e-12)) << what;
        }
      }
    }
  }
}

// Linear layers reading one x, each with a LoRA adapter of the same scale (q, k, v; gate and up),
// run as one autograd node under the fused kernels (fan_out_linear: the A factors stacked, x's
// gradient one chain of GEMMs). Its outputs and the gradients of x and of every parameter equal
// the fused kernels off (each layer and its adapter's own layers) in float64: ranks that differ,
// an output without a gradient, at once and deferred to a WeightGradQueue, the base weights
// trained and frozen. Scales that differ fall back to a node per layer, with the same values.
TEST(Peft_Lora, AdaptedLayersReadingOneInputAreOneNodeEqualToTheComposition) {
  struct Qkv : torch::nn::Module {
    Qkv() {
      for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
        layers.emplace_back(register_module(name, d9d::model::Linear(12, 8)));
      }
    }
    std::vector<d9d::model::Linear> layers;
  };
  struct Run {
    std::string node;
    std::vector<at::Tensor> tensors;  // the outputs, x's gradient, every parameter's
  };
  const auto run = [](const peft::StackSpec& spec, bool fused, bool frozen, bool deferred) {
    torch::manual_seed(5);
    const auto module = std::make_shared<Qkv>();  // apply_stack walks it as a shared module
    auto& qkv = *module;
    qkv.to(at::kDouble);
    peft::apply_stack(qkv, spec);
    randomize_adapters(qkv);
    for (auto& layer : qkv.layers) {
      layer->weight.requires_grad_(!frozen);
    }
    torch::manual_seed(6);
    const auto x = at::randn({2, 5, 12}, at::kDouble).requires_grad_();
    const auto g0 = at::randn({2, 5, 8}, at::kDouble);
    const auto g2 = at::randn({2, 5, 8}, at::kDouble);
    d9d::model::set_fused_kernels(fused);
    d9d::WeightGradQueue queue;
    std::vector<at::Tensor> out;
    {
      const d9d::RecordWeightGrads record(queue);
      out = d9d::model::fan_out_linear(
          x, {qkv.layers[0].get(), qkv.layers[1].get(), qkv.layers[2].get()});
    }
    const auto loss = (out[0] * g0).sum() + (out[2] * g2).sum();  // k's output unused
    {
      const d9d::DeferWeightGrads defer(queue);
      if (deferred) {
        loss.backward();
      }
    }
    if (deferred) {
      queue.drain();
    } else {
      loss.backward();
    }
    d9d::model::set_fused_kernels(true);
    Run r{.node = out[0].grad_fn()->name(),
          .tensors = {out[0].detach(), out[1].detach(), out[2].detach(), x.grad()}};
    for (const auto& item : qkv.named_parameters()) {
      r.tensors.push_back(item.value().grad());
    }
    return r;
  };
  // Ranks 3 and 2 at one scale (6 / 3 = 4 / 2); then scales 2 and 1.
  const auto same_scale = peft::stack_spec<
      peft::Stack<peft::Lora<3, 6, "q_proj">, peft::Lora<2, 4, "k_proj", "v_proj">>>();
  const auto two_scales = peft::stack_spec<
      peft::Stack<peft::Lora<3, 6, "q_proj">, peft::Lora<2, 2, "k_proj", "v_proj">>>();
  for (const bool frozen : {false, true}) {
    for (const bool stacked : {true, false}) {
      const auto& spec = stacked ? same_scale : two_scales;
      const auto want = run(spec, false, frozen, false);
      for (const bool deferred : {false, true}) {
        const auto got = run(spec, true, frozen, deferred);
        EXPECT_THAT(got.node, HasSubstr(stacked ? "LowRankFanOutLinear" : "LowRankLinear"));
        ASSERT_EQ(got.tensors.size(), want.tensors.size());
        for (std::size_t i = 0; i < got.tensors.size(); ++i) {
          const auto what =
              "tensor " + std::to_string(i) + (frozen ? ", W frozen" : ", W trained") +
              (stacked ? ", one scale" : ", two scales") + (deferred ? ", deferred" : "");
          ASSERT_EQ(got.tensors[i].defined(), want.tensors[i].defined()) << what;
          if (want.tensors[i].defined()) {
            EXPECT_TRUE(at::allclose(got.tensors[i], want.tensors[i], 1e-12, 1e-12)) << what;
          }
        }
      }
    }
  }
}

TEST(Peft_Stack_LoraAndNorms, GradientsOnTheAdaptersAndTheNorms) {
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<LoraAndNorms>());
  randomize_adapters(*model);
  model(tokens()).pow(2).mean().backward();
  expect_gradients_only_on(*model, [](const std::string& name) {
    return name.find(".lora_") != std::string::npos ||
           name.find("norm.weight") != std::string::npos;
  });
}

TEST(Peft_Stack_FreezeEmbedding, TheRestTrains) {
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<peft::Freeze<"model.embed_tokens", "*.mlp">>());
  model(tokens()).pow(2).mean().backward();
  expect_gradients_only_on(*model, [](const std::string& name) {
    return name != "model.embed_tokens.weight" && name.find(".mlp.") == std::string::npos;
  });
}

TEST(Peft_Stack_LoraAndFullTune, AdaptersAndEverythingButTheWrappedWeights) {
  auto model = tiny_model();
  peft::apply_stack(*model,
                    peft::stack_spec<peft::Stack<peft::Lora<4, 8, "q_proj">, peft::FullTune>>());
  randomize_adapters(*model);
  model(tokens()).pow(2).mean().backward();
  expect_gradients_only_on(*model, [](const std::string& name) {
    return name.find("q_proj.weight") == std::string::npos;
  });
}

TEST(Peft_Lora_LmHead, TheLossRunsTheHeadsAdapter) {
  // Qwen3's loss fuses the head with the cross-entropy (linear_cross_entropy reads lm_head.weight
  // alone); with an adapter on the head it must run the layer, adapter included.
  ASSERT_TRUE(d9d::model::fused_kernels());
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8, "lm_head">>());
  randomize_adapters(*model);
  const auto ids = tokens();
  const auto labels = ids.roll(-1, 1);
  const auto plain = d9d::model::causal_lm_loss(model(ids), labels);
  const auto got = model->loss(ids, labels);
  EXPECT_EQ(got.tokens.item<int64_t>(), plain.tokens.item<int64_t>());
  EXPECT_TRUE(at::equal(got.loss_sum, plain.loss_sum))
      << got.loss_sum.item<double>() << " vs " << plain.loss_sum.item<double>();
  peft::merge(*model);
  const auto merged = model->loss(ids, labels);  // merged: the adapter adds nothing, W carries it
  EXPECT_NEAR(merged.loss_sum.item<double>(), plain.loss_sum.item<double>(),
              1e-12 * std::abs(plain.loss_sum.item<double>()));
  peft::unmerge(*model);
  model->loss(ids, labels).loss_sum.backward();
  expect_gradients_only_on(
      *model, [](const std::string& name) { return name.rfind("lm_head.lora_", 0) == 0; });
}

TEST(Peft_Lora_r4, SplitBackwardQueuesTheAdaptersWeightGradients) {
  // A zero-bubble pipeline's B action computes input gradients, its W action the weights'.
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  randomize_adapters(*model);
  const auto ids = tokens();
  model(ids).pow(2).mean().backward();
  const auto want = snapshot(*model);
  std::map<std::string, at::Tensor> want_grads;
  for (const auto& item : model->named_parameters()) {
    if (item.value().grad().defined()) {
      want_grads[item.key()] = item.value().grad().clone();
      item.value().mutable_grad() = at::Tensor();
    }
  }
  d9d::WeightGradQueue queue;
  at::Tensor out;
  {
    const d9d::RecordWeightGrads record(queue);
    out = model(ids).pow(2).mean();
  }
  {
    const d9d::DeferWeightGrads defer(queue);
    out.backward();
  }
  EXPECT_FALSE(queue.empty()) << "the adapters' weight gradients wait for W";
  for (const auto& [name, grad] : want_grads) {
    EXPECT_FALSE(model->named_parameters()[name].grad().defined()) << name << " before W";
  }
  queue.drain();
  for (const auto& [name, grad] : want_grads) {
    EXPECT_TRUE(at::allclose(model->named_parameters()[name].grad(), grad, 1e-12, 1e-14)) << name;
  }
}

// ---- start-up errors -------------------------------------------------------------------------

std::string scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
}

// ---- LoRA on grouped experts ------------------------------------------------------------------

// Layer 0 has 4 experts (top 2, hidden 32, expert width 16), layer 1 a dense MLP.
d9d::model::Qwen3MoeForCausalLM tiny_moe_model() {
  torch::manual_seed(5);
  d9d::model::Qwen3MoeForCausalLM model(d9d::model::Qwen3MoeConfig::from_json_text(
      R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "tie_word_embeddings": false, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
          "mlp_only_layers": [1]})"));
  model->to(at::kDouble);
  return model;
}

using ExpertProjections = peft::Lora<4, 8, "gate_proj", "up_proj", "down_proj">;

TEST(Peft_ExpertLora, AdaptsEveryExpertWithStackedFactors) {
  auto model = tiny_moe_model();
  model->eval();
  const auto ids = tokens();
  const auto plain = model(ids).detach();
  peft::apply_stack(*model, peft::stack_spec<ExpertProjections>());
  std::vector<std::string> names;
  for (const auto& layer : peft::lora_layers(*model)) {
    names.push_back(layer.name +
                    (layer.num_experts() > 0 ? " x" + std::to_string(layer.num_experts()) : ""));
  }
  EXPECT_THAT(
      names, ::testing::ElementsAre(
                 "model.layers.0.mlp.experts.gate_proj x4", "model.layers.0.mlp.experts.up_proj x4",
                 "model.layers.0.mlp.experts.down_proj x4", "model.layers.1.mlp.gate_proj",
                 "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"));
  const auto parameters = model->named_parameters();
  EXPECT_EQ(parameters["model.layers.0.mlp.experts.gate_proj_lora_A"].sizes(),
            (std::vector<int64_t>{4, 4, 32}));
  EXPECT_EQ(parameters["model.layers.0.mlp.experts.gate_proj_lora_B"].sizes(),
            (std::vector<int64_t>{4, 16, 4}));
  EXPECT_EQ(parameters["model.layers.0.mlp.experts.down_proj_lora_A"].sizes(),
            (std::vector<int64_t>{4, 4, 16}));
  EXPECT_EQ(parameters["model.layers.0.mlp.experts.down_proj_lora_B"].sizes(),
            (std::vector<int64_t>{4, 32, 4}));
  for (const auto& item : parameters) {
    EXPECT_EQ(item.value().requires_grad(), item.key().find("lora_") != std::string::npos)
        << item.key();
  }
  EXPECT_TRUE(at::equal(model(ids), plain)) << "fresh adapters (B = 0) change nothing";
  // Each expert's A is drawn on its own, as peft draws one per expert layer: not all alike.
  const auto& a = parameters["model.layers.0.mlp.experts.up_proj_lora_A"];
  EXPECT_FALSE(at::equal(a.select(0, 0), a.select(0, 1)));
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(32.0));
}

// The experts' output against the definition: expert e's rows through W_e + scale B_e A_e in each
// projection, forward and every adapter gradient; then merge and unmerge on the whole model.
TEST(Peft_ExpertLora, EachExpertComputesItsOwnAdapterAndMergesExactly) {
  auto model = tiny_moe_model();
  peft::apply_stack(*model, peft::stack_spec<ExpertProjections>());
  randomize_adapters(*model);
  auto& experts =
      *model->model->layers[0]->as<d9d::model::Qwen3MoeDecoderLayerImpl>()->moe->experts;
  auto generator = at::detail::createCPUGenerator(23);
  const auto x = at::randn({10, 32}, generator, at::kDouble);
  const std::vector<int64_t> counts = {3, 0, 5, 2};  // an expert without rows too
  const auto y = experts.forward(x, counts);
  const auto probe = at::randn(y.sizes(), generator, at::kDouble);
  (y * probe).sum().backward();

  // The reference: leaf copies of the factors, one expert at a time.
  std::vector<at::Tensor> a;
  std::vector<at::Tensor> b;
  std::vector<at::Tensor> adapted;
  for (std::size_t p = 0; p < 3; ++p) {
    const auto& adapter = dynamic_cast<peft::ExpertLoraAdapter&>(*experts.adapters.at(p));
    a.push_back(adapter.lora_A.detach().clone().requires_grad_());
    b.push_back(adapter.lora_B.detach().clone().requires_grad_());
    EXPECT_DOUBLE_EQ(adapter.options().scale(), 2.0);
    adapted.push_back(experts.projection(p).detach() + 2.0 * at::matmul(b[p], a[p]));
  }
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int64_t e = 0; e < 4; ++e) {
    const auto rows = x.narrow(0, offset, counts[static_cast<std::size_t>(e)]);
    offset += counts[static_cast<std::size_t>(e)];
    const auto h = at::silu(at::linear(rows, adapted[0][e])) * at::linear(rows, adapted[1][e]);
    parts.push_back(at::linear(h, adapted[2][e]));
  }
  const auto want = at::cat(parts, 0);
  (want * probe).sum().backward();
  EXPECT_TRUE(at::allclose(y, want, 1e-12, 1e-12))
      << "max diff " << (y - want).abs().max().item<double>();
  for (std::size_t p = 0; p < 3; ++p) {
    const auto& adapter = dynamic_cast<peft::ExpertLoraAdapter&>(*experts.adapters.at(p));
    EXPECT_TRUE(at::allclose(adapter.lora_A.grad(), a[p].grad(), 1e-12, 1e-12)) << p;
    EXPECT_TRUE(at::allclose(adapter.lora_B.grad(), b[p].grad(), 1e-12, 1e-12)) << p;
    EXPECT_FALSE(experts.projection(p).grad().defined()) << "the base stays frozen";
  }
  const auto& up = dynamic_cast<peft::ExpertLoraAdapter&>(*experts.adapters.at(1));
  EXPECT_EQ(up.lora_A.grad().select(0, 1).abs().max().item<double>(), 0.0)
      << "expert 1 had no rows";

  model->eval();
  const auto ids = tokens();
  const auto lora = model(ids).detach();
  const auto before = snapshot(*model);
  peft::merge(*model);
  EXPECT_TRUE(at::allclose(experts.down_proj, adapted[2].detach(), 0.0, 1e-15));
  EXPECT_TRUE(at::allclose(model(ids), lora, 0.0, 1e-12));
  peft::unmerge(*model);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), before.at(item.key()))) << item.key();
  }
}

TEST(Peft_ExpertLora, AdapterFilesHoldEachExpertUnderPeftsKeys) {
  auto model = tiny_moe_model();
  const auto base = snapshot(*model);
  using Mixed = peft::Stack<peft::Lora<4, 8, "q_proj", "gate_proj", "up_proj">,
                            peft::Lora<2, 6, "down_proj">>;
  peft::apply_stack(*model, peft::stack_spec<Mixed>());
  randomize_adapters(*model);
  model->eval();
  const auto ids = tokens();
  const auto want = model(ids).detach();
  const auto dir = scratch("peft_expert_adapter");
  peft::save_adapter(*model, dir, {.dtype = at::kDouble});

  const auto config =
      nlohmann::json::parse(d9d::model::read_text_file(dir + "/adapter_config.json"));
  EXPECT_EQ(config["target_modules"],
            nlohmann::json({"q_proj", "gate_proj", "up_proj", "down_proj"}));
  const auto pattern = nlohmann::json({{R"(model\.layers\.0\.mlp\.experts\.[0-9]+\.down_proj)", 2},
                                       {R"(model\.layers\.1\.mlp\.down_proj)", 2}});
  EXPECT_EQ(config["rank_pattern"], pattern);
  EXPECT_EQ(config["modules_to_save"], nullptr);
  const d9d::state::SafetensorsFile file(dir + "/adapter_model.safetensors");
  // q_proj x 2 layers, 3 dense projections, 3 x 4 expert ones; A and B each.
  EXPECT_EQ(file.entries().size(), 2U * (2 + 3 + 12));
  const auto parameters = model->named_parameters();
  for (int64_t e = 0; e < 4; ++e) {
    const auto key = "base_model.model.model.layers.0.mlp.experts." + std::to_string(e) +
                     ".down_proj.lora_A.weight";
    ASSERT_TRUE(file.contains(key)) << key;
    EXPECT_TRUE(at::equal(file.tensor(key),
                          parameters["model.layers.0.mlp.experts.down_proj_lora_A"].select(0, e)));
  }

  auto fresh = tiny_moe_model();
  fresh->eval();
  for (const auto& item : fresh->named_parameters()) {
    ASSERT_TRUE(at::equal(item.value(), base.at(item.key()))) << "the same base model";
  }
  peft::load_adapter(*fresh, dir);
  EXPECT_TRUE(at::equal(fresh(ids), want));
  EXPECT_EQ(peft::lora_layers(*fresh).size(), 2U + 3U + 3U);
  auto same = tiny_moe_model();
  same->eval();
  peft::apply_stack(*same, peft::stack_spec<Mixed>());
  peft::load_adapter_weights(*same, dir);
  EXPECT_TRUE(at::equal(same(ids), want));

  // An adapter on some experts of a projection only: d9d stacks every expert's factors.
  auto partial = config;
  partial["target_modules"] = {"q_proj", "model.layers.0.mlp.experts.1.gate_proj"};
  partial["rank_pattern"] = nlohmann::json::object();
  partial["alpha_pattern"] = nlohmann::json::object();
  const auto partial_dir = scratch("peft_partial_experts");
  peft::save_adapter(*model, partial_dir, {.dtype = at::kDouble});
  {
    std::FILE* out = std::fopen((partial_dir + "/adapter_config.json").c_str(), "w");
    ASSERT_NE(out, nullptr);
    std::fputs(partial.dump().c_str(), out);
    std::fclose(out);
  }
  auto other = tiny_moe_model();
  EXPECT_THAT(
      d9d::testing::error_of<std::runtime_error>([&] { peft::load_adapter(*other, partial_dir); }),
      HasSubstr("targets 1 of the 4 experts of model.layers.0.mlp.experts.gate_proj"));
  EXPECT_TRUE(peft::lora_layers(*other).empty()) << "the model is left as it was";
}

// The merged Qwen3-MoE as transformers' checkpoint: per-expert tensors with the adapters merged
// in, no adapter tensor; it loads back with the adapted model's logits.
TEST(Peft_ExpertLora, MergedExportWritesTransformersPerExpertTensors) {
  auto model = tiny_moe_model();
  peft::apply_stack(*model, peft::stack_spec<ExpertProjections>());
  randomize_adapters(*model);
  model->eval();
  const auto ids = tokens();
  const auto want = model(ids).detach();
  const auto dir = scratch("peft_merged_moe");
  peft::save_merged_hf_checkpoint(*model, dir, model->config().to_hf_json(), at::kDouble);
  EXPECT_FALSE(peft::lora_layers(*model).front().merged()) << "left as it was";
  const d9d::state::SafetensorsFile file(dir + "/model.safetensors");
  EXPECT_TRUE(file.contains("model.layers.0.mlp.experts.3.down_proj.weight"));
  EXPECT_FALSE(file.contains("model.layers.0.mlp.experts.down_proj"));
  for (const auto& entry : file.entries()) {
    EXPECT_EQ(entry.name.find("lora"), std::string::npos) << entry.name;
  }
  // Into a float64 Qwen3-MoE (the file's dtype), streamed through transformers' names.
  d9d::model::Qwen3MoeForCausalLM loaded(model->config());
  loaded->to(at::kDouble);
  d9d::model::load_hf_qwen3_moe_into(*loaded, model->config(), dir);
  loaded->eval();
  EXPECT_TRUE(at::allclose(loaded(ids), want, 0.0, 1e-12))
      << "max diff " << (loaded(ids) - want).abs().max().item<double>();
}

TEST(Peft_ExpertLora, DropoutOnExpertsIsRefused) {
  auto model = tiny_moe_model();
  const auto error = d9d::testing::error_of<std::invalid_argument>([&] {
    peft::apply_stack(*model,
                      peft::stack_spec<peft::Lora<4, 8, "*.experts.up_proj">::with_dropout<10>>());
  });
  EXPECT_THAT(error, HasSubstr("matches model.layers.0.mlp.experts.up_proj, a stacked expert "
                               "projection, where LoRA takes no dropout"));
  EXPECT_TRUE(peft::lora_layers(*model).empty());
}

TEST(Peft_Errors, APatternThatMatchesNothingListsTheModules) {
  auto model = tiny_model();
  const auto message = d9d::testing::error_of<std::invalid_argument>(
      [&] { peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8, "*.qproj">>()); });
  EXPECT_THAT(message, HasSubstr(R"(the pattern "*.qproj" of d9d::peft::Lora<4, 8, "*.qproj">)"));
  EXPECT_THAT(message, HasSubstr(R"(did you mean "*.q_proj"?)"));
  EXPECT_THAT(message, HasSubstr("model.layers.*.self_attn.q_proj (Linear)"));
  EXPECT_THAT(message, HasSubstr("model.embed_tokens (Embedding)"));
  EXPECT_THAT(message, HasSubstr("Fix:"));
  EXPECT_FALSE(peft::has_lora(*model)) << "nothing is changed when the stack is rejected";
  for (const auto& parameter : model->parameters()) {
    EXPECT_TRUE(parameter.requires_grad());
  }
  const auto freeze = d9d::testing::error_of<std::invalid_argument>(
      [&] { peft::apply_stack(*model, peft::stack_spec<peft::Freeze<"model.embed">>()); });
  EXPECT_THAT(freeze,
              HasSubstr(R"(the pattern "model.embed" of d9d::peft::Freeze<"model.embed">)"));
}

TEST(Peft_Errors, LoraOnAModuleThatIsNotLinear) {
  auto model = tiny_model();
  const auto message = d9d::testing::error_of<std::invalid_argument>(
      [&] { peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8, "*.mlp">>()); });
  EXPECT_THAT(message, HasSubstr("matches model.layers.0.mlp, a SwiGlu; LoRA wraps linear layers"));
  EXPECT_THAT(message, HasSubstr("model.layers.*.mlp.up_proj (Linear)"));
}

TEST(Peft_Errors, TwoMethodsClaimingOneParameter) {
  auto model = tiny_model();
  using Overlap = peft::Stack<peft::Lora<4, 8, "*.q_proj">, peft::Freeze<"model.layers.0.*">>;
  const auto message = d9d::testing::error_of<std::invalid_argument>(
      [&] { peft::apply_stack(*model, peft::stack_spec<Overlap>()); });
  EXPECT_THAT(message, HasSubstr("model.layers.0.self_attn.q_proj.weight is claimed by "
                                 R"(d9d::peft::Lora<4, 8, "*.q_proj"> (pattern "*.q_proj"))"));
  EXPECT_THAT(message, HasSubstr(R"(d9d::peft::Freeze<"model.layers.0.*">)"));
  const auto twice = d9d::testing::error_of<std::invalid_argument>([&] {
    peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8, "*.q_proj">>());
    peft::apply_stack(*model, peft::stack_spec<peft::Lora<4, 8, "*.k_proj", "q_proj">>());
  });
  EXPECT_THAT(twice, HasSubstr("already has an adapter"));
}

// ---- adapter files and the merged export --------------------------------------------------------

TEST(Peft_Adapter, SavedAdapterLoadsIntoTheBaseModelWithTheSameLogits) {
  auto model = tiny_model();
  const auto base = snapshot(*model);
  using Mixed = peft::Stack<peft::Lora<4, 8, "q_proj", "v_proj">,
                            peft::Lora<2, 6, "*.1.mlp.up_proj">, peft::Train<"model.norm">>;
  peft::apply_stack(*model, peft::stack_spec<Mixed>());
  randomize_adapters(*model);
  {
    const at::NoGradGuard no_grad;
    model->model->norm->weight.mul_(1.5);  // a trained module to save
  }
  model->eval();
  const auto ids = tokens();
  const auto want = model(ids).detach();
  const auto dir = scratch("peft_adapter");
  peft::save_adapter(*model, dir, {.base_model_name_or_path = "tiny", .dtype = at::kDouble});

  const auto config =
      nlohmann::json::parse(d9d::model::read_text_file(dir + "/adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8);
  EXPECT_EQ(config["target_modules"],
            nlohmann::json({"q_proj", "v_proj", "model.layers.1.mlp.up_proj"}));
  EXPECT_EQ(config["rank_pattern"], nlohmann::json({{R"(model\.layers\.1\.mlp\.up_proj)", 2}}));
  EXPECT_EQ(config["alpha_pattern"], nlohmann::json({{R"(model\.layers\.1\.mlp\.up_proj)", 6}}));
  EXPECT_EQ(config["modules_to_save"], nlohmann::json({"model.norm"}));
  EXPECT_EQ(config["base_model_name_or_path"], "tiny");
  const d9d::state::SafetensorsFile file(dir + "/adapter_model.safetensors");
  EXPECT_TRUE(file.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(file.contains("base_model.model.model.norm.weight"));
  EXPECT_EQ(file.entries().size(), 2U * (2 * 2 + 1) + 1);

  auto fresh = tiny_model();
  fresh->eval();
  for (const auto& item : fresh->named_parameters()) {
    ASSERT_TRUE(at::equal(item.value(), base.at(item.key()))) << "the same base model";
  }
  peft::load_adapter(*fresh, dir);
  EXPECT_TRUE(at::equal(fresh(ids), want));
  for (const auto& parameter : fresh->parameters()) {
    EXPECT_FALSE(parameter.requires_grad()) << "loaded for inference";
  }
  EXPECT_EQ(peft::lora_layers(*fresh).size(), 5U);

  // Into a model that has the same adapters (e.g. one a Trainer built).
  auto same = tiny_model();
  same->eval();
  peft::apply_stack(*same, peft::stack_spec<Mixed>());
  peft::load_adapter_weights(*same, dir);
  EXPECT_TRUE(at::equal(same(ids), want));
  auto other = tiny_model();
  peft::apply_stack(*other, peft::stack_spec<peft::Lora<8, 8, "q_proj", "v_proj">>());
  EXPECT_THAT(
      d9d::testing::error_of<std::runtime_error>([&] { peft::load_adapter_weights(*other, dir); }),
      HasSubstr("has rank 8 and scale 1.000000, the file rank 4 and scale 2.000000"));
}

TEST(Peft_Adapter, MergedExportIsAPlainHuggingFaceCheckpoint) {
  auto model = tiny_model();
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  randomize_adapters(*model);
  model->eval();
  const auto ids = tokens();
  const auto want = model(ids).detach();
  const auto before = snapshot(*model);
  const auto dir = scratch("peft_merged");
  peft::save_merged_hf_checkpoint(*model, dir, model->config().to_hf_json(), at::kDouble);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), before.at(item.key()))) << "left as it was: " << item.key();
  }
  EXPECT_FALSE(peft::lora_layers(*model).front().adapter->merged());
  const d9d::state::SafetensorsFile file(dir + "/model.safetensors");
  for (const auto& entry : file.entries()) {
    EXPECT_EQ(entry.name.find("lora"), std::string::npos) << entry.name;
  }
  // A plain Qwen3 in float64 (the file's dtype) takes it; any other tensor would be an error.
  d9d::model::Qwen3ForCausalLM loaded(model->config());
  loaded->to(at::kDouble);
  d9d::model::load_hf_checkpoint(*loaded, dir);
  loaded->eval();
  EXPECT_TRUE(at::allclose(loaded(ids), want, 0.0, 1e-12));
}

TEST(Peft_Adapter, ErrorsNameTheProblem) {
  auto model = tiny_model();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { peft::save_adapter(*model, scratch("none")); }),
              HasSubstr("the model has no LoRA adapter"));
  const auto dir = scratch("peft_bad");
  peft::apply_stack(*model, peft::stack_spec<QvLora>());
  peft::save_adapter(*model, dir);
  auto config = nlohmann::json::parse(d9d::model::read_text_file(dir + "/adapter_config.json"));
  config["use_dora"] = true;
  {
    std::FILE* out = std::fopen((dir + "/adapter_config.json").c_str(), "w");
    std::fputs(config.dump().c_str(), out);
    std::fclose(out);
  }
  auto fresh = tiny_model();
  EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] { peft::load_adapter(*fresh, dir); }),
              HasSubstr(R"("use_dora" = true (a LoRA variant) is not supported by d9d)"));
  EXPECT_FALSE(peft::has_lora(*fresh));
  peft::save_adapter(*model, dir);
  auto narrow = d9d::model::Qwen3ForCausalLM(d9d::model::Qwen3Config::from_json_text(
      R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0})"));
  EXPECT_THAT(
      d9d::testing::error_of<std::runtime_error>([&] { peft::load_adapter(*narrow, dir); }),
      HasSubstr("unexpected base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"));
  EXPECT_FALSE(peft::has_lora(*narrow)) << "a rejected file leaves no adapter behind";
}

// ---- training
// ------------------------------------------------------------------------------------

d9d::DistributedContext local() { return d9d::DistributedContext::local({.device = "cpu"}); }

// Windows of a counting sequence (each token is the previous one + 1, mod 64): learnable.
class CountingWindows {
 public:
  explicit CountingWindows(int64_t sequence_length) : length_(sequence_length) {}
  [[nodiscard]] int64_t size() const { return 64; }
  [[nodiscard]] d9d::CausalLmBatch get(const std::vector<int64_t>& indices) const {
    auto starts = at::tensor(indices, at::kLong).unsqueeze(1);
    return {.tokens = (starts + at::arange(length_ + 1, at::kLong).unsqueeze(0)).remainder(64)};
  }

 private:
  int64_t length_;
};

struct CountingProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  [[nodiscard]] CountingWindows build(const d9d::DataBuildContext& context) const {
    return CountingWindows(context.sequence_length);
  }
};

TEST(Peft_Trainer_Lora_r4, TrainsOnlyTheAdaptersAndLowersTheLoss) {
  using Plan = d9d::Plan<QvLora, Fp64>;
  auto config = tiny_run(scratch("peft_train"), 24, 8, 4);
  config.optimizer.lr = 0.03;
  d9d::Trainer<Plan> trainer(local(), d9d::Qwen3Provider{}, CountingProvider{}, d9d::CausalLmTask{},
                             config);
  const auto result = trainer.train();
  ASSERT_EQ(result.losses.size(), 24U);
  EXPECT_LT(result.losses.back(), result.losses.front() - 0.1)  // 4.168 -> 3.984 measured
      << result.losses.front() << " -> " << result.losses.back();
  auto& parallel = trainer.core().parallel();
  ASSERT_EQ(parallel.parameters().size(), 8U) << "only the adapters have records";
  int64_t adapter_bytes = 0;
  for (const auto& record : parallel.parameters()) {
    EXPECT_NE(record.name.find(".lora_"), std::string::npos) << record.name;
    adapter_bytes += static_cast<int64_t>(record.local.nbytes());
  }
  for (const auto& item : trainer.core().model()->named_parameters()) {
    const bool lora = item.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(item.value().grad().defined(), lora)
        << "frozen parameters have no .grad: " << item.key();
  }
  EXPECT_EQ(parallel.gradient_bytes(), adapter_bytes);
  EXPECT_EQ(parallel.parameter_bytes(), adapter_bytes);
}

TEST(Peft_Trainer_Lora_r4, GradientMemoryIsTheAdaptersOnly) {
  d9d::Trainer<d9d::Plan<Fp64>> full(local(), d9d::Qwen3Provider{},
                                     d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                     tiny_run(scratch("peft_full"), 2, 8, 8));
  (void)full.train();
  d9d::Trainer<d9d::Plan<QvLora, Fp64>> lora(
      local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      tiny_run(scratch("peft_lora"), 2, 8, 8));
  (void)lora.train();
  const int64_t full_bytes = full.core().parallel().gradient_bytes();
  const int64_t lora_bytes = lora.core().parallel().gradient_bytes();
  // The tiny Qwen3: 2 layers of q, v adapters of rank 4, float64.
  EXPECT_EQ(lora_bytes, int64_t{2} * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4) * 8);
  EXPECT_EQ(full_bytes, d9d::peft::count_parameters(*full.core().model()).total * 8);
  EXPECT_LT(lora_bytes * 10, full_bytes) << "LoRA " << lora_bytes << " B, full " << full_bytes;
}

TEST(Peft_Trainer_Lora_r4, FullyShardOnOneRankTrainsLikeReplicate) {
  using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
  d9d::Trainer<d9d::Plan<QvLora, Fp64>> replicate(
      local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      tiny_run(scratch("peft_rep"), 4, 8, 2));
  const auto want = replicate.train();
  d9d::Trainer<d9d::Plan<Mesh, d9d::parallel::Fsdp, QvLora, Fp64>> sharded(
      local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      tiny_run(scratch("peft_fsdp"), 4, 8, 2));
  const auto got = sharded.train();
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], d9d::testing::kLossRtol * want.losses[i]);
  }
}

// Raised by a StepEnd handler to stop a run after a given step, as a crash would.
struct Stop : std::runtime_error {
  Stop() : std::runtime_error("stopped by the test") {}
};

TEST(Peft_Trainer_Lora_r4, CheckpointsHoldOnlyTheAdaptersAndResumeExactly) {
  using Plan = d9d::Plan<QvLora, Fp64>;
  d9d::Trainer<Plan> straight(local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              d9d::CausalLmTask{}, tiny_run(scratch("peft_straight"), 6, 8, 4));
  const auto want = straight.train();
  const auto dir = scratch("peft_ckpt");
  auto config = tiny_run(dir, 6, 8, 4);
  config.checkpoint.every = 3;
  config.checkpoint.async = false;
  config.checkpoint.dir = dir + "/checkpoints";
  {
    d9d::Trainer<Plan> first(local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
    first.on<d9d::events::StepEnd>([](const d9d::events::StepEnd& e) {
      if (e.step == 3) {
        throw Stop();
      }
    });
    EXPECT_THROW((void)first.train(), Stop);
  }
  // The checkpoint holds what trains: the adapters and their AdamW state, not the frozen base.
  const d9d::state::SafetensorsFile file(dir + "/checkpoints/step-3/rank-0.safetensors");
  int parameters = 0;
  for (const auto& entry : file.entries()) {
    if (entry.name.rfind("rng/", 0) == 0) {
      continue;
    }
    EXPECT_NE(entry.name.find(".lora_"), std::string::npos) << entry.name;
    parameters += entry.name.rfind("model/", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(parameters, 8) << "(A, B) x (q, v) x 2 layers";
  // Resumed on a base the provider builds again: the run continues exactly.
  d9d::Trainer<Plan> resumed(local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
  const auto got = resumed.train();
  EXPECT_EQ(got.start_step, 3);
  ASSERT_EQ(got.losses.size(), 3U);
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], want.losses[i + 3]) << "step " << i + 3;
  }
  const auto want_parameters = straight.core().model()->named_parameters();
  for (const auto& item : resumed.core().model()->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), want_parameters[item.key()])) << item.key();
  }
}

TEST(Peft_Trainer_Lora_r4, ExportsTheMergedModelAndTheAdapter) {
  using Plan = d9d::Plan<QvLora, Fp64>;
  const auto dir = scratch("peft_export");
  d9d::Trainer<Plan> trainer(local(), d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, tiny_run(dir, 3, 8, 4, /*outputs=*/true));
  const auto result = trainer.train();
  EXPECT_EQ(result.adapter_dir, dir + "/adapter");
  auto& model = *trainer.core().model();
  model.eval();
  const auto ids = tokens();
  auto& qwen = dynamic_cast<d9d::model::Qwen3ForCausalLMImpl&>(model);
  const auto want = qwen.forward(ids).detach();
  auto merged = d9d::model::load_hf_qwen3(result.export_dir);  // float32 export
  merged->to(at::kDouble);
  merged->eval();
  EXPECT_TRUE(at::allclose(merged(ids), want, 1e-5, 1e-5));
  // The adapter on the base model the provider built (the run's seed, 5): the same logits.
  torch::manual_seed(5);
  d9d::model::Qwen3ForCausalLM base(d9d::model::Qwen3Config::from_json_text(tiny_qwen3_json()));
  base->to(at::kDouble);
  base->eval();
  peft::load_adapter(*base, result.adapter_dir);
  EXPECT_TRUE(at::allclose(base(ids), want, 1e-5, 1e-5));
}

}  // namespace
