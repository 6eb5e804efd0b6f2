// d9d's LoRA adapters against Hugging Face's peft library (0.17.1 in tools/setup's transformers
// environment, run through D9D_HF_PYTHON): an adapter d9d saves loads in peft
// (PeftModel.from_pretrained) on the transformers model with the same logits, and an adapter peft
// saves (regular-expression targets, rank and alpha patterns, rsLoRA, a module to save) loads in
// d9d with the same logits. The bases are the tiny transformers checkpoints of tests/hf/fixtures:
// Qwen3, and Qwen3-MoE for LoRA on the experts (transformers 4's per-expert layers in peft).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/subprocess.hpp"

namespace {

namespace peft = d9d::peft;
using ::testing::HasSubstr;

std::string fixture(const std::string& name = "qwen3_tiny_untied") {
  const char* dir = std::getenv("D9D_HF_FIXTURES");
  return d9d::files::join(dir != nullptr ? dir : "tests/hf/fixtures", name);
}

// Runs peft_check.py with `args`; returns its exit status and output.
std::pair<int, std::string> run_check(const std::string& args) {
  const char* python = std::getenv("D9D_HF_PYTHON");
  const char* check = std::getenv("D9D_PEFT_CHECK");
  if (python == nullptr || check == nullptr) {
    ADD_FAILURE() << "D9D_HF_PYTHON and D9D_PEFT_CHECK must be set (tools/test passes them; "
                     "tools/setup installs transformers and peft)";
    return {-1, ""};
  }
  const auto run =
      d9d::testing::run_command("'" + std::string(python) + "' '" + check + "' " + args + " 2>&1");
  return {run.status, run.command + "\n" + run.output};
}

at::Tensor named(const d9d::state::NamedTensors& tensors, const std::string& name) {
  for (const auto& [key, value] : tensors) {
    if (key == name) {
      return value;
    }
  }
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

// B normal (B = 0 would hide every mistake), for linear layers and stacked experts alike.
void randomize_b(torch::nn::Module& model) {
  const at::NoGradGuard no_grad;
  at::manual_seed(13);
  for (const auto& layer : peft::lora_layers(model)) {
    (layer.expert_adapter != nullptr ? layer.expert_adapter->lora_B : layer.adapter->lora_B->weight)
        .normal_(0.0, 0.2);
  }
}

// Saves `model`'s adapter and its logits, and has peft load the adapter on the transformers model
// in `base` and compare; expects `adapted` layers in peft's model.
template <class Model>
void expect_peft_reads(Model& model, const std::string& base, const std::string& name,
                       int adapted) {
  model->eval();
  const std::string dir = d9d::files::join(testing::TempDir(), name);
  peft::save_adapter(*model, dir, {.base_model_name_or_path = base});
  const auto ids = at::randint(model->config().vocab_size, {3, 10}, at::kLong);
  at::Tensor logits;
  {
    const at::NoGradGuard no_grad;
    logits = model(ids);
  }
  const std::string reference = d9d::files::join(testing::TempDir(), name + "_logits.safetensors");
  d9d::state::save_safetensors(reference, {{"input_ids", ids}, {"logits", logits}});
  const auto [status, output] = run_check("load '" + base + "' '" + dir + "' '" + reference + "'");
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PeftModel over " + std::to_string(adapted) + " adapted layers"));
}

// Has peft make and save an adapter on `base` (q_proj, v_proj and down_proj targeted by a regular
// expression, down_proj at rank 2 and alpha 6, rsLoRA, model.norm to save) and loads it into
// `model` (the same base) with the same logits.
template <class Model>
void expect_reads_peft(Model& model, const std::string& base, const std::string& name) {
  const std::string dir = d9d::files::join(testing::TempDir(), name);
  const auto [status, output] = run_check("save '" + base + "' '" + dir + "'");
  ASSERT_EQ(status, 0) << output;
  peft::load_adapter(*model, dir);
  model->eval();
  const auto layers = peft::lora_layers(*model);
  ASSERT_EQ(layers.size(), 6U) << "q, v, down of 2 layers (the experts' down_proj as one)";
  for (const auto& layer : layers) {
    const bool down = layer.name.find("down_proj") != std::string::npos;
    EXPECT_EQ(layer.options().rank, down ? 2 : 4) << layer.name;
    EXPECT_DOUBLE_EQ(layer.options().scale(), down ? 6 / std::sqrt(2.0) : 8 / 2.0)
        << layer.name << ": rsLoRA scales by alpha / sqrt(r)";
  }
  const auto reference =
      d9d::state::load_safetensors(d9d::files::join(dir, "reference.safetensors"));
  const at::NoGradGuard no_grad;
  const at::Tensor logits = model(named(reference, "input_ids"));
  const at::Tensor want = named(reference, "logits");
  EXPECT_TRUE(at::allclose(logits, want, 1e-5, 1e-5))
      << "max diff " << (logits - want).abs().max().item<double>();
  // Without the module to save (peft's copy of the final norm) the logits differ: it was read.
  model->model->norm->weight.div_(1.5);
  EXPECT_FALSE(at::allclose(model(named(reference, "input_ids")), want, 1e-5, 1e-5));
}

TEST(Peft_Hf, OurAdapterLoadsInPeftWithTheSameLogits) {
  auto model = d9d::model::load_hf_qwen3(fixture());
  // Two ranks, a layer of its own (rank_pattern, alpha_pattern) and the final norm trained
  // (modules_to_save).
  using Peft =
      peft::Stack<peft::Lora<4, 8, "q_proj", "v_proj">,
                  peft::Lora<2, 6, "model.layers.1.mlp.down_proj">, peft::Train<"model.norm">>;
  peft::apply_stack(*model, peft::stack_spec<Peft>(), 5);
  randomize_b(*model);
  {
    const at::NoGradGuard no_grad;
    model->model->norm->weight.mul_(1.25);
  }
  expect_peft_reads(model, fixture(), "d9d_adapter", 5);
}

TEST(Peft_Hf, PeftsAdapterLoadsHereWithTheSameLogits) {
  auto model = d9d::model::load_hf_qwen3(fixture());
  expect_reads_peft(model, fixture(), "peft_adapter");
}

// LoRA on the experts of Qwen3-MoE (layer 0: 4 experts; layer 1 dense): peft sees transformers 4's
// per-expert linear layers, d9d stacked factors; the files agree expert by expert.
TEST(Peft_Hf, OurExpertAdapterLoadsInPeftWithTheSameLogits) {
  const auto base = fixture("qwen3_moe_tiny_norm");
  auto model = d9d::model::load_hf_qwen3_moe(base);
  using Peft = peft::Stack<peft::Lora<4, 8, "q_proj", "gate_proj", "up_proj">,
                           peft::Lora<8, 6, "down_proj">>;
  peft::apply_stack(*model, peft::stack_spec<Peft>(), 5);
  randomize_b(*model);
  // q_proj x 2, the dense layer's 3 projections, each of the 4 experts' 3.
  expect_peft_reads(model, base, "d9d_expert_adapter", 2 + 3 + 12);
}

TEST(Peft_Hf, PeftsExpertAdapterLoadsHereWithTheSameLogits) {
  const auto base = fixture("qwen3_moe_tiny_norm");
  auto model = d9d::model::load_hf_qwen3_moe(base);
  expect_reads_peft(model, base, "peft_expert_adapter");
  const auto layers = peft::lora_layers(*model);
  EXPECT_EQ(std::count_if(layers.begin(), layers.end(),
                          [](const auto& layer) { return layer.num_experts() == 4; }),
            1)
      << "layer 0's experts' down_proj, stacked";
}

}  // namespace
