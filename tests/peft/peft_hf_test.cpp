// d9d's LoRA adapters against Hugging Face's peft library (0.17.1 in tools/setup's transformers
// environment, run through D9D_HF_PYTHON): an adapter d9d saves loads in peft
// (PeftModel.from_pretrained) on the transformers model with the same logits, and an adapter peft
// saves (regular-expression targets, rank and alpha patterns, rsLoRA, a module to save) loads in
// d9d with the same logits. The base is the tiny transformers checkpoint of tests/hf/fixtures.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/subprocess.hpp"

namespace {

namespace peft = d9d::peft;
using ::testing::HasSubstr;

std::string fixture() {
  const char* dir = std::getenv("D9D_HF_FIXTURES");
  return d9d::files::join(dir != nullptr ? dir : "tests/hf/fixtures", "qwen3_tiny_untied");
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

TEST(Peft_Hf, OurAdapterLoadsInPeftWithTheSameLogits) {
  auto model = d9d::model::load_hf_qwen3(fixture());
  // Two ranks, a layer of its own (rank_pattern, alpha_pattern) and the final norm trained
  // (modules_to_save).
  using Peft =
      peft::Stack<peft::Lora<4, 8, "q_proj", "v_proj">,
                  peft::Lora<2, 6, "model.layers.1.mlp.down_proj">, peft::Train<"model.norm">>;
  peft::apply_stack(*model, peft::stack_spec<Peft>(), 5);
  {
    const at::NoGradGuard no_grad;
    at::manual_seed(13);
    for (const auto& layer : peft::lora_layers(*model)) {
      layer.adapter->lora_B->weight.normal_(0.0, 0.2);  // B = 0 would hide every mistake
    }
    model->model->norm->weight.mul_(1.25);
  }
  model->eval();
  const std::string dir = d9d::files::join(testing::TempDir(), "d9d_adapter");
  peft::save_adapter(*model, dir, {.base_model_name_or_path = fixture()});
  const auto ids = at::randint(model->config().vocab_size, {3, 10}, at::kLong);
  at::Tensor logits;
  {
    const at::NoGradGuard no_grad;
    logits = model(ids);
  }
  const std::string reference = d9d::files::join(testing::TempDir(), "d9d_lora_logits.safetensors");
  d9d::state::save_safetensors(reference, {{"input_ids", ids}, {"logits", logits}});
  const auto [status, output] =
      run_check("load '" + fixture() + "' '" + dir + "' '" + reference + "'");
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, HasSubstr("PeftModel over 5 adapted layers"));
}

TEST(Peft_Hf, PeftsAdapterLoadsHereWithTheSameLogits) {
  const std::string dir = d9d::files::join(testing::TempDir(), "peft_adapter");
  const auto [status, output] = run_check("save '" + fixture() + "' '" + dir + "'");
  ASSERT_EQ(status, 0) << output;
  auto model = d9d::model::load_hf_qwen3(fixture());
  peft::load_adapter(*model, dir);
  model->eval();
  const auto layers = peft::lora_layers(*model);
  ASSERT_EQ(layers.size(), 6U) << "q, v, down of 2 layers";
  for (const auto& layer : layers) {
    const bool down = layer.name.find("down_proj") != std::string::npos;
    EXPECT_EQ(layer.adapter->options().rank, down ? 2 : 4) << layer.name;
    EXPECT_DOUBLE_EQ(layer.adapter->options().scale(), down ? 6 / std::sqrt(2.0) : 8 / 2.0)
        << layer.name << ": rsLoRA scales by alpha / sqrt(r)";
  }
  const auto reference =
      d9d::state::load_safetensors(d9d::files::join(dir, "reference.safetensors"));
  const at::NoGradGuard no_grad;
  const auto logits = model(named(reference, "input_ids"));
  const auto want = named(reference, "logits");
  EXPECT_TRUE(at::allclose(logits, want, 1e-5, 1e-5))
      << "max diff " << (logits - want).abs().max().item<double>();
  // Without the module to save (peft's copy of the final norm) the logits differ: it was read.
  model->model->norm->weight.div_(1.5);
  EXPECT_FALSE(at::allclose(model(named(reference, "input_ids")), want, 1e-5, 1e-5));
}

}  // namespace
