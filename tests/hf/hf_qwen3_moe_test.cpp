// Qwen3-MoE against Hugging Face transformers, both ways: checkpoints written by
// transformers 4.57.1 and 5.17.0 (tests/hf/make_moe_fixtures.py, committed: norm_topk_prob true and
// false, dense layers by mlp_only_layers and by decoder_sparse_step, tied, sharded) load into d9d's
// Qwen3-MoE with the reference logits and auxiliary loss; d9d's export loads in transformers with
// the same logits (tests/hf/hf_check.py through D9D_HF_PYTHON); transformers 5's fused expert
// layout loads too; and the config reader's MoE rules (include/d9d/model/qwen3_moe.hpp).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/model/hf.hpp>
#include <d9d/model/hf_moe.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/hf/hf_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using hf_test::fixture;
using hf_test::named;

struct MoeFixture {
  std::string name;
  int transformers = 4;
  bool norm_topk_prob = false;
  int64_t moe_layers = 0;
  bool sharded = false;
};

const MoeFixture kFixtures[] = {
    // 2 layers, layer 1 dense by mlp_only_layers.
    {.name = "qwen3_moe_tiny_norm", .transformers = 4, .norm_topk_prob = true, .moe_layers = 1},
    // 3 layers, decoder_sparse_step 2: only layer 1 is sparse; tied head.
    {.name = "qwen3_moe_tiny_nonorm_tied", .transformers = 4, .moe_layers = 1},
    // num_local_experts, rope theta 5e5 in rope_parameters, layer 0 dense.
    {.name = "qwen3_moe_tiny_v5_norm", .transformers = 5, .norm_topk_prob = true, .moe_layers = 1},
    // 3 layers, layer 2 dense, four shards.
    {.name = "qwen3_moe_tiny_v5_nonorm_sharded",
     .transformers = 5,
     .moe_layers = 2,
     .sharded = true},
};

class Hf_Qwen3Moe : public ::testing::TestWithParam<MoeFixture> {};

TEST_P(Hf_Qwen3Moe, TransformersCheckpointGivesTheReferenceLogitsAndAuxLoss) {
  const MoeFixture& f = GetParam();
  const auto dir = fixture(f.name);
  const auto saved = nlohmann::json::parse(d9d::model::read_text_file(dir + "/config.json"));
  EXPECT_EQ(saved.at("transformers_version").get<std::string>().substr(0, 2),
            std::to_string(f.transformers) + ".");
  EXPECT_TRUE(saved.contains(f.transformers == 5 ? "num_local_experts" : "num_experts"));
  EXPECT_EQ(d9d::files::exists(dir + "/model.safetensors.index.json"), f.sharded);

  auto model = d9d::model::load_hf_qwen3_moe(dir);
  EXPECT_EQ(model->config().norm_topk_prob, f.norm_topk_prob);
  EXPECT_EQ(model->config().num_experts, 4);
  EXPECT_EQ(d9d::model::moe_layers(*model).size(), static_cast<std::size_t>(f.moe_layers));
  const auto reference =
      d9d::state::load_safetensors(d9d::files::join(dir, "reference.safetensors"));
  const auto want = named(reference, "logits");
  const at::NoGradGuard no_grad;
  const auto logits = model(named(reference, "input_ids"));
  EXPECT_TRUE(at::allclose(logits, want, 1e-5, 1e-5))
      << "max diff " << (logits - want).abs().max().item<double>();
  EXPECT_NEAR(model->last_aux_loss(), named(reference, "aux_loss").item<double>(), 1e-5);
}

// d9d's own weights exported and read by transformers (4.57.1 through D9D_HF_PYTHON): the same
// logits; the file holds transformers' per-expert names; d9d reads its export back exactly.
TEST_P(Hf_Qwen3Moe, OurExportLoadsInTransformersWithTheSameLogits) {
  const auto check = hf_test::hf_check();
  if (!check) {
    return;
  }
  const std::string name = GetParam().name;
  const auto config = d9d::model::Qwen3MoeConfig::from_json_text(
      d9d::model::read_text_file(d9d::files::join(fixture(name), "config.json")));
  at::manual_seed(11);
  d9d::model::Qwen3MoeForCausalLM model(config);
  {
    const at::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      const double scale = item.key().ends_with("mlp.gate.weight") ? 0.5 : 0.05;
      item.value().add_(scale * at::randn_like(item.value()));
    }
  }
  const std::string tmp = testing::TempDir();
  const std::string dir = d9d::files::join(tmp, "d9d_moe_export_" + name);
  d9d::model::save_hf_qwen3_moe(*model, dir);
  const auto file = d9d::state::SafetensorsFile(d9d::files::join(dir, "model.safetensors"));
  const std::string layer = name == "qwen3_moe_tiny_v5_norm" ? "1"
                            : name == "qwen3_moe_tiny_norm"  ? "0"
                                                             : "1";
  EXPECT_TRUE(file.contains("model.layers." + layer + ".mlp.experts.3.down_proj.weight"));
  EXPECT_FALSE(file.contains("model.layers." + layer + ".mlp.experts.down_proj"));
  const auto ids = at::randint(config.vocab_size, {3, 9}, at::kLong);
  at::Tensor logits;
  {
    const at::NoGradGuard no_grad;
    logits = model(ids);
  }
  const std::string reference = d9d::files::join(tmp, "d9d_moe_logits_" + name + ".safetensors");
  d9d::state::save_safetensors(reference, {{"input_ids", ids}, {"logits", logits}});
  const auto run = hf_test::run_hf_check(*check, dir, reference);
  EXPECT_EQ(run.status, 0) << run.command << "\n" << run.output;
  EXPECT_THAT(run.output, HasSubstr("Qwen3MoeForCausalLM"));
  // Our count of the parameters (every expert's) is transformers' count of the same model.
  EXPECT_THAT(run.output,
              HasSubstr("transformers parameters: " + std::to_string(config.parameter_count())));
  auto again = d9d::model::load_hf_qwen3_moe(dir);
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(again(ids), logits));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Hf_Qwen3Moe, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) { return info.param.name; });

// transformers 5 keeps experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H],
// mlp.experts.down_proj [E, H, I]); a checkpoint in that layout loads to the same model.
TEST(Hf_Qwen3Moe_Layouts, TheFusedLayoutOfTransformers5Loads) {
  const auto source = fixture("qwen3_moe_tiny_v5_norm");
  const auto tensors = d9d::state::load_safetensors(d9d::files::join(source, "model.safetensors"));
  d9d::state::NamedTensors fused;
  std::vector<at::Tensor> gate, up, down;
  for (const auto& [key, tensor] : tensors) {
    if (key.find(".mlp.experts.") == std::string::npos) {
      fused.emplace_back(key, tensor);
    }
  }
  for (int e = 0; e < 4; ++e) {
    const std::string p = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
    gate.push_back(named(tensors, p + "gate_proj.weight"));
    up.push_back(named(tensors, p + "up_proj.weight"));
    down.push_back(named(tensors, p + "down_proj.weight"));
  }
  fused.emplace_back("model.layers.1.mlp.experts.gate_up_proj",
                     at::cat({at::stack(gate), at::stack(up)}, 1));
  fused.emplace_back("model.layers.1.mlp.experts.down_proj", at::stack(down));
  const std::string dir = d9d::files::join(testing::TempDir(), "fused_v5");
  d9d::files::create_directories(dir);
  d9d::state::save_safetensors(d9d::files::join(dir, "model.safetensors"), fused);
  const auto config = d9d::model::Qwen3MoeConfig::from_json_text(
      d9d::model::read_text_file(d9d::files::join(source, "config.json")));
  d9d::model::Qwen3MoeForCausalLM model(config);
  d9d::model::load_hf_qwen3_moe_into(*model, config, dir);
  auto reference_model = d9d::model::load_hf_qwen3_moe(source);
  for (const auto& item : reference_model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), model->named_parameters()[item.key()])) << item.key();
  }
}

TEST(Hf_Qwen3Moe_Layouts, AMissingExpertIsNamedBeforeAnyRead) {
  const auto source = fixture("qwen3_moe_tiny_norm");
  auto tensors = d9d::state::load_safetensors(d9d::files::join(source, "model.safetensors"));
  std::erase_if(tensors, [](const auto& item) {
    return item.first == "model.layers.0.mlp.experts.2.up_proj.weight";
  });
  const std::string dir = d9d::files::join(testing::TempDir(), "missing_expert");
  d9d::files::create_directories(dir);
  d9d::state::save_safetensors(d9d::files::join(dir, "model.safetensors"), tensors);
  const auto config = d9d::model::Qwen3MoeConfig::from_json_text(
      d9d::model::read_text_file(d9d::files::join(source, "config.json")));
  d9d::model::Qwen3MoeForCausalLM model(config);
  const auto before = model->model->norm->weight.clone();
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { d9d::model::load_hf_qwen3_moe_into(*model, config, dir); }),
              AllOf(HasSubstr("missing input"),
                    HasSubstr("\"model.layers.0.mlp.experts.2.up_proj.weight\"")));
  EXPECT_TRUE(at::equal(model->model->norm->weight, before)) << "nothing read";
}

// ------------------------------------------------------------------------------------------------
// The config reader

nlohmann::json tiny() {
  return nlohmann::json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16})");
}

std::string error_for(const nlohmann::json& json) {
  return d9d::testing::error_of<std::invalid_argument>(
      [&] { (void)d9d::model::Qwen3MoeConfig::from_json_text(json.dump()); });
}

TEST(Hf_Qwen3MoeConfig, EveryKeyTransformersWritesIsKnown) {
  for (const char* file : {"configs/qwen3_moe-transformers-4.57.1-full.json",
                           "configs/qwen3_moe-transformers-5.17.0-full.json"}) {
    const auto text = d9d::model::read_text_file(fixture(file));
    EXPECT_GT(nlohmann::json::parse(text).size(), 30U) << file;
    const auto config = d9d::model::Qwen3MoeConfig::from_json_text(text);
    EXPECT_EQ(config.num_experts, 4) << file;
    EXPECT_TRUE(config.norm_topk_prob) << file;
  }
  // Qwen3-30B-A3B's published config.json.
  const auto hub = d9d::model::Qwen3MoeConfig::from_json_text(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  EXPECT_EQ(hub.parameter_count() / 100000000, 305);        // 30.5B
  EXPECT_EQ(hub.active_parameter_count() / 100000000, 33);  // 3.3B active
  EXPECT_EQ(hub.aux_loss_coef(), 0.0) << "output_router_logits false: no aux loss, as HF";
}

TEST(Hf_Qwen3MoeConfig, ExpertCountInEitherNameAndTheyMustAgree) {
  auto v5 = tiny();
  v5.erase("num_experts");
  v5["num_local_experts"] = 8;
  EXPECT_EQ(d9d::model::Qwen3MoeConfig::from_json_text(v5.dump()).num_experts, 8);
  auto both = tiny();
  both["num_local_experts"] = 8;
  EXPECT_THAT(error_for(both), AllOf(HasSubstr("\"num_experts\" = 4 and \"num_local_experts\" = 8"),
                                     HasSubstr("Fix: give the count once")));
  auto none = tiny();
  none.erase("num_experts");
  EXPECT_THAT(error_for(none), HasSubstr("missing required key \"num_experts\""));
  auto no_k = tiny();
  no_k.erase("num_experts_per_tok");
  EXPECT_THAT(error_for(no_k), HasSubstr("\"num_experts_per_tok\""));
}

TEST(Hf_Qwen3MoeConfig, UnknownKeysGetASuggestionAmongBothReaders) {
  auto typo = tiny();
  typo["num_expert_per_tok"] = 2;
  EXPECT_THAT(error_for(typo), AllOf(HasSubstr("d9d Qwen3-MoE config: unknown key"),
                                     HasSubstr("(did you mean \"num_experts_per_tok\"?)")));
  auto dense_typo = tiny();
  dense_typo["hiden_size"] = 2;
  EXPECT_THAT(error_for(dense_typo), HasSubstr("(did you mean \"hidden_size\"?)"));
}

TEST(Hf_Qwen3MoeConfig, ValuesAreCheckedAndTheDenseRulesApply) {
  auto family = tiny();
  family["model_type"] = "qwen2_moe";
  EXPECT_THAT(error_for(family), HasSubstr("\"model_type\" = \"qwen2_moe\" is invalid"));
  auto too_many = tiny();
  too_many["num_experts_per_tok"] = 5;
  EXPECT_THAT(error_for(too_many), HasSubstr("\"num_experts_per_tok\" = 5 is invalid"));
  auto layer = tiny();
  layer["mlp_only_layers"] = {0, 3};
  EXPECT_THAT(error_for(layer), HasSubstr("\"mlp_only_layers[1]\" = 3 is invalid"));
  auto coef = tiny();
  coef["router_aux_loss_coef"] = -1;
  EXPECT_THAT(error_for(coef), HasSubstr("\"router_aux_loss_coef\" = -1 is invalid"));
  auto rope = tiny();
  rope["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THAT(error_for(rope), AllOf(HasSubstr("d9d Qwen3-MoE config: \"rope_scaling.rope_type\""),
                                     HasSubstr("default RoPE only")));
  auto window = tiny();
  window["use_sliding_window"] = true;
  EXPECT_THAT(error_for(window), HasSubstr("\"use_sliding_window\" = true is invalid"));
  // The dense reader points a Qwen3-MoE config at this one.
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { (void)d9d::model::Qwen3Config::from_json_text(tiny().dump()); }),
              HasSubstr("read Qwen3-MoE configs with d9d::model::Qwen3MoeConfig"));
}

TEST(Hf_Qwen3MoeConfig, SparseLayersFollowTransformers) {
  auto json = tiny();
  json["num_hidden_layers"] = 6;
  json["decoder_sparse_step"] = 2;
  json["mlp_only_layers"] = {3};
  const auto config = d9d::model::Qwen3MoeConfig::from_json_text(json.dump());
  std::vector<bool> sparse;
  for (int64_t i = 0; i < 6; ++i) {
    sparse.push_back(config.is_moe_layer(i));
  }
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
}

TEST(Hf_Qwen3MoeConfig, OurExportReadsBackToTheSameConfig) {
  auto json = tiny();
  json.update(nlohmann::json::parse(R"({"norm_topk_prob": true, "mlp_only_layers": [2],
      "router_aux_loss_coef": 0.02, "output_router_logits": true, "decoder_sparse_step": 1,
      "shared_expert_intermediate_size": 24, "router_bias_update_rate": 0.001,
      "router_bias_update_rule": "proportional", "router_aux_loss_type": "sequence",
      "moe_capacity_factor": 1.25})"));
  const auto config = d9d::model::Qwen3MoeConfig::from_json_text(json.dump());
  const auto again = d9d::model::Qwen3MoeConfig::from_json_text(config.to_hf_json());
  EXPECT_EQ(again.mlp_only_layers, std::vector<int64_t>{2});
  EXPECT_EQ(again.shared_expert_intermediate_size, 24);
  EXPECT_EQ(again.router_bias_update_rate, 0.001);
  EXPECT_EQ(again.router_bias_update_rule, d9d::model::MoeBiasRule::proportional);
  EXPECT_EQ(again.moe_options().bias_update_rule, d9d::model::MoeBiasRule::proportional);
  EXPECT_EQ(again.router_aux_loss_type, d9d::model::MoeAuxLoss::sequence);
  EXPECT_EQ(again.moe_options().capacity_factor, 1.25);
  json["router_aux_loss_type"] = "per_sequence";
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::model::Qwen3MoeConfig::from_json_text(json.dump()); }),
              HasSubstr("expected \"global_batch\" or \"sequence\""));
  json["router_aux_loss_type"] = "global_batch";
  json["moe_capacity_factor"] = -1;
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::model::Qwen3MoeConfig::from_json_text(json.dump()); }),
              HasSubstr("moe_capacity_factor"));
  json["moe_capacity_factor"] = 0;
  json["router_bias_update_rule"] = "signum";
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::model::Qwen3MoeConfig::from_json_text(json.dump()); }),
              HasSubstr("expected \"sign\" or \"proportional\""));
  EXPECT_EQ(again.aux_loss_coef(), 0.02);
  EXPECT_TRUE(again.norm_topk_prob);
  EXPECT_EQ(again.parameter_count(), config.parameter_count());
}

}  // namespace
