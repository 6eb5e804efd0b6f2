// Qwen3 against Hugging Face transformers, both ways: checkpoints written by transformers
// (tests/hf/make_fixtures.py, committed) load into d9d's Qwen3 with the same logits, and d9d's
// export loads back in transformers with the same logits (tests/hf/hf_check.py, run through
// D9D_HF_PYTHON, which tools/setup provides).
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;

std::string fixture(const std::string& name) {
  const char* dir = std::getenv("D9D_HF_FIXTURES");
  return d9d::files::join(dir != nullptr ? dir : "tests/hf/fixtures", name);
}

at::Tensor named(const d9d::state::NamedTensors& tensors, const std::string& name) {
  for (const auto& [key, tensor] : tensors) {
    if (key == name) {
      return tensor;
    }
  }
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

class Hf_Qwen3 : public ::testing::TestWithParam<std::string> {};

TEST_P(Hf_Qwen3, TransformersCheckpointGivesTheReferenceLogits) {
  const auto dir = fixture(GetParam());
  auto model = d9d::model::load_hf_qwen3(dir);
  EXPECT_EQ(model->config().tie_word_embeddings, GetParam() == "qwen3_tiny_tied");
  const auto reference =
      d9d::state::load_safetensors(d9d::files::join(dir, "reference.safetensors"));
  const auto ids = named(reference, "input_ids");
  const auto want = named(reference, "logits");
  const at::NoGradGuard no_grad;
  const auto logits = model(ids);
  EXPECT_TRUE(at::allclose(logits, want, 1e-5, 1e-5))
      << "max diff " << (logits - want).abs().max().item<double>();
}

TEST_P(Hf_Qwen3, OurExportLoadsInTransformersWithTheSameLogits) {
  const char* python = std::getenv("D9D_HF_PYTHON");
  const char* check = std::getenv("D9D_HF_CHECK");
  if (python == nullptr || check == nullptr) {
    FAIL() << "D9D_HF_PYTHON and D9D_HF_CHECK must be set (tools/test passes them; tools/setup "
              "installs transformers)";
  }
  // Our own weights: the fixture's config, d9d's initialisation.
  const auto config = d9d::model::Qwen3Config::from_json_text(
      d9d::model::read_text_file(d9d::files::join(fixture(GetParam()), "config.json")));
  at::manual_seed(11);
  d9d::model::Qwen3ForCausalLM model(config);
  {
    const at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      p.add_(0.05 * at::randn_like(p));  // norms away from one
    }
  }
  const std::string tmp = testing::TempDir();
  const std::string dir = d9d::files::join(tmp, "d9d_export_" + GetParam());
  d9d::model::save_hf_checkpoint(*model, dir, config.to_hf_json());
  const auto ids = at::randint(config.vocab_size, {3, 9}, at::kLong);
  at::Tensor logits;
  {
    const at::NoGradGuard no_grad;
    logits = model(ids);
  }
  const std::string reference = d9d::files::join(tmp, "d9d_logits_" + GetParam() + ".safetensors");
  d9d::state::save_safetensors(reference, {{"input_ids", ids}, {"logits", logits}});
  const std::string command =
      "'" + std::string(python) + "' '" + check + "' '" + dir + "' '" + reference + "' 2>&1";
  std::FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    output += buffer;
  }
  const int status = pclose(pipe);
  EXPECT_EQ(status, 0) << command << "\n" << output;
  EXPECT_THAT(output, HasSubstr("Qwen3ForCausalLM"));
  // And back: our loader reads our export.
  auto again = d9d::model::load_hf_qwen3(dir);
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(again(ids), logits));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Hf_Qwen3,
                         ::testing::Values("qwen3_tiny_untied", "qwen3_tiny_tied"));

TEST(Hf_Checkpoint, MismatchesAreListedBeforeAnyCopy) {
  auto config = d9d::model::Qwen3Config::from_json_text(
      d9d::model::read_text_file(fixture("qwen3_tiny_untied/config.json")));
  config.intermediate_size = 40;  // every MLP weight has another shape
  d9d::model::Qwen3ForCausalLM model(config);
  const auto before = model->model->norm->weight.clone();
  const auto message = d9d::testing::error_of(
      [&] { d9d::model::load_hf_checkpoint(*model, fixture("qwen3_tiny_untied")); });
  EXPECT_THAT(message,
              HasSubstr("model.layers.0.mlp.down_proj.weight (file [32, 48], model [32, 40])"));
  EXPECT_TRUE(at::equal(model->model->norm->weight, before));  // nothing copied
  // An untied model cannot take a tied checkpoint: it has no LM head there.
  d9d::model::Qwen3ForCausalLM untied_reader(d9d::model::Qwen3Config::from_json_text(
      d9d::model::read_text_file(fixture("qwen3_tiny_untied/config.json"))));
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::model::load_hf_checkpoint(*untied_reader, fixture("qwen3_tiny_tied"));
              }),
              HasSubstr("missing lm_head.weight"));
  EXPECT_THAT(d9d::testing::error_of([] { (void)d9d::model::load_hf_qwen3("/nonexistent"); }),
              HasSubstr("cannot read /nonexistent/config.json"));
}

}  // namespace
