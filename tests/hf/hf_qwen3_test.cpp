// Qwen3 against Hugging Face transformers, both ways: checkpoints written by transformers 4 and 5
// (tests/hf/make_fixtures.py, committed; one sharded) load into d9d's Qwen3 with the same logits,
// and d9d's export loads back in transformers with the same logits (tests/hf/hf_check.py, run
// through D9D_HF_PYTHON, which tools/setup provides). Also the config reader's rules
// (include/d9d/model/qwen3.hpp): both forms of the rope theta, rejected keys, unknown and missing
// keys, ranges.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/model/hf.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/hf/hf_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using hf_test::fixture;
using hf_test::named;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

/// A fresh copy of fixture `name` (its files) under the test's temporary directory.
std::string copy_of(const std::string& name, const std::string& copy) {
  const std::string dir = d9d::files::join(testing::TempDir(), copy);
  d9d::files::remove_tree(dir);
  d9d::files::create_directories(dir);
  for (const char* file :
       {"config.json", "model.safetensors", "model.safetensors.index.json",
        "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"}) {
    const std::string from = d9d::files::join(fixture(name), file);
    if (d9d::files::exists(from)) {
      write_file(d9d::files::join(dir, file), d9d::model::read_text_file(from));
    }
  }
  return dir;
}

// ------------------------------------------------------------------------------------------------
// Checkpoints written by transformers

struct Fixture {
  std::string name;
  int transformers = 4;  ///< the major version that wrote it
  bool tied = false;
  double rope_theta = 0;
  bool sharded = false;
};

const Fixture kFixtures[] = {
    {.name = "qwen3_tiny_untied", .transformers = 4, .tied = false, .rope_theta = 1e4},
    {.name = "qwen3_tiny_tied", .transformers = 4, .tied = true, .rope_theta = 1e4},
    {.name = "qwen3_tiny_v5_untied_rope5e5", .transformers = 5, .tied = false, .rope_theta = 5e5},
    {.name = "qwen3_tiny_v5_tied_sharded",
     .transformers = 5,
     .tied = true,
     .rope_theta = 1e6,
     .sharded = true},
};

class Hf_Qwen3 : public ::testing::TestWithParam<Fixture> {};

TEST_P(Hf_Qwen3, TransformersCheckpointGivesTheReferenceLogits) {
  const Fixture& f = GetParam();
  const auto dir = fixture(f.name);
  // The fixture is what this test claims to read: the config form and the file layout.
  const auto saved = nlohmann::json::parse(d9d::model::read_text_file(dir + "/config.json"));
  EXPECT_EQ(saved.at("transformers_version").get<std::string>().substr(0, 2),
            std::to_string(f.transformers) + ".");
  if (f.transformers == 5) {
    EXPECT_FALSE(saved.contains("rope_theta"));
    EXPECT_EQ(saved.at("rope_parameters").at("rope_theta").get<double>(), f.rope_theta);
  } else {
    EXPECT_EQ(saved.at("rope_theta").get<double>(), f.rope_theta);
  }
  EXPECT_EQ(d9d::files::exists(dir + "/model.safetensors"), !f.sharded);
  EXPECT_EQ(d9d::files::exists(dir + "/model.safetensors.index.json"), f.sharded);

  auto model = d9d::model::load_hf_qwen3(dir);
  EXPECT_EQ(model->config().tie_word_embeddings, f.tied);
  EXPECT_EQ(model->config().rope_theta, f.rope_theta);
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
  const auto check = hf_test::hf_check();
  if (!check) {
    return;
  }
  const std::string name = GetParam().name;
  // Our own weights: the fixture's config, d9d's initialisation.
  const auto config = d9d::model::Qwen3Config::from_json_text(
      d9d::model::read_text_file(d9d::files::join(fixture(name), "config.json")));
  at::manual_seed(11);
  d9d::model::Qwen3ForCausalLM model(config);
  {
    const at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      p.add_(0.05 * at::randn_like(p));  // norms away from one
    }
  }
  const std::string tmp = testing::TempDir();
  const std::string dir = d9d::files::join(tmp, "d9d_export_" + name);
  d9d::model::save_hf_checkpoint(*model, dir, config.to_hf_json());
  const auto ids = at::randint(config.vocab_size, {3, 9}, at::kLong);
  at::Tensor logits;
  {
    const at::NoGradGuard no_grad;
    logits = model(ids);
  }
  const std::string reference = d9d::files::join(tmp, "d9d_logits_" + name + ".safetensors");
  d9d::state::save_safetensors(reference, {{"input_ids", ids}, {"logits", logits}});
  const auto run = hf_test::run_hf_check(*check, dir, reference);
  EXPECT_EQ(run.status, 0) << run.command << "\n" << run.output;
  EXPECT_THAT(run.output, HasSubstr("Qwen3ForCausalLM"));
  // Our count of the parameters (Qwen3Config::parameter_count, which MFU figures use) is
  // transformers' count of the same model.
  EXPECT_THAT(run.output,
              HasSubstr("transformers parameters: " + std::to_string(config.parameter_count())));
  // And back: our loader reads our export.
  auto again = d9d::model::load_hf_qwen3(dir);
  EXPECT_EQ(again->config().rope_theta, GetParam().rope_theta);
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(again(ids), logits));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Hf_Qwen3, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) { return info.param.name; });

// The v5 fixture's theta is not the default, and the logits depend on it: a reader that fell back
// to a default theta would fail the test above.
TEST(Hf_Qwen3_v5, TheThetaInRopeParametersChangesTheLogits) {
  const auto dir = fixture("qwen3_tiny_v5_untied_rope5e5");
  auto config =
      d9d::model::Qwen3Config::from_json_text(d9d::model::read_text_file(dir + "/config.json"));
  ASSERT_EQ(config.rope_theta, 5e5);
  const auto reference = d9d::state::load_safetensors(dir + "/reference.safetensors");
  const at::NoGradGuard no_grad;
  for (const double theta : {1e4, 1e6}) {
    config.rope_theta = theta;
    d9d::model::Qwen3ForCausalLM model(config);
    d9d::model::load_hf_checkpoint(*model, dir);
    const auto logits = model(named(reference, "input_ids"));
    EXPECT_GT((logits - named(reference, "logits")).abs().max().item<double>(), 1e-3)
        << "theta " << theta;
  }
}

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
  // An untied model cannot take a tied checkpoint: it has no LM head there (single or sharded).
  d9d::model::Qwen3ForCausalLM untied_reader(d9d::model::Qwen3Config::from_json_text(
      d9d::model::read_text_file(fixture("qwen3_tiny_untied/config.json"))));
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::model::load_hf_checkpoint(*untied_reader, fixture("qwen3_tiny_tied"));
              }),
              HasSubstr("missing lm_head.weight"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                d9d::model::load_hf_checkpoint(*untied_reader,
                                               fixture("qwen3_tiny_v5_tied_sharded"));
              }),
              AllOf(HasSubstr("model.safetensors.index.json does not fit the model"),
                    HasSubstr("missing lm_head.weight")));
  EXPECT_THAT(d9d::testing::error_of([] { (void)d9d::model::load_hf_qwen3("/nonexistent"); }),
              HasSubstr("cannot read /nonexistent/config.json"));
}

TEST(Hf_Checkpoint, ShardsMustMatchTheirIndex) {
  const std::string dir = copy_of("qwen3_tiny_v5_tied_sharded", "bad_index");
  auto index =
      nlohmann::json::parse(d9d::model::read_text_file(dir + "/model.safetensors.index.json"));
  ASSERT_EQ(index["weight_map"]["model.norm.weight"], "model-00004-of-00004.safetensors");
  index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors";
  write_file(dir + "/model.safetensors.index.json", index.dump());
  auto config =
      d9d::model::Qwen3Config::from_json_text(d9d::model::read_text_file(dir + "/config.json"));
  d9d::model::Qwen3ForCausalLM model(config);
  const auto before = model->model->embed_tokens->weight.clone();  // in shard 1
  EXPECT_THAT(
      d9d::testing::error_of([&] { d9d::model::load_hf_checkpoint(*model, dir); }),
      AllOf(HasSubstr("d9d::model::load_hf_checkpoint"), HasSubstr("\"model.norm.weight\"")));
  EXPECT_TRUE(at::equal(model->model->embed_tokens->weight, before));
}

TEST(Hf_Checkpoint, TheSingleFileWinsOverAnIndexAndNeitherIsAnError) {
  const std::string dir = copy_of("qwen3_tiny_untied", "single_and_index");
  write_file(dir + "/model.safetensors.index.json", "not an index");  // never read
  auto model = d9d::model::load_hf_qwen3(dir);
  const auto reference =
      d9d::state::load_safetensors(fixture("qwen3_tiny_untied") + "/reference.safetensors");
  const at::NoGradGuard no_grad;
  EXPECT_TRUE(
      at::allclose(model(named(reference, "input_ids")), named(reference, "logits"), 1e-5, 1e-5));
  const std::string empty = copy_of("qwen3_tiny_untied", "config_only");
  std::remove((empty + "/model.safetensors").c_str());
  EXPECT_THAT(d9d::testing::error_of([&] { (void)d9d::model::load_hf_qwen3(empty); }),
              HasSubstr("holds neither model.safetensors nor model.safetensors.index.json"));
}

// ------------------------------------------------------------------------------------------------
// The config reader

nlohmann::json tiny() {
  return nlohmann::json::parse(R"({"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0})");
}

d9d::model::Qwen3Config read(const nlohmann::json& json) {
  return d9d::model::Qwen3Config::from_json_text(json.dump());
}

std::string error_reading(const std::string& text) {
  return d9d::testing::error_of<std::invalid_argument>(
      [&] { (void)d9d::model::Qwen3Config::from_json_text(text); });
}

std::string error_reading(const nlohmann::json& json) { return error_reading(json.dump()); }

TEST(Hf_Qwen3Config, BothTransformersFormsOfTheThetaAreRead) {
  auto v4 = tiny();
  v4["rope_theta"] = 5e5;
  v4["rope_scaling"] = nullptr;
  EXPECT_EQ(read(v4).rope_theta, 5e5);
  auto v5 = tiny();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  EXPECT_EQ(read(v5).rope_theta, 5e5);
  auto both = v5;
  both["rope_theta"] = 500000;  // the same value written as an integer
  EXPECT_EQ(read(both).rope_theta, 5e5);
  auto scaling = tiny();
  scaling.erase("rope_theta");
  scaling["rope_scaling"] = {{"type", "default"}, {"rope_theta", 2e5}};
  EXPECT_EQ(read(scaling).rope_theta, 2e5);
}

TEST(Hf_Qwen3Config, ThetasThatDisagreeAreRejectedNamingBoth) {
  auto json = tiny();
  json["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  EXPECT_THAT(error_reading(json), HasSubstr("d9d Qwen3 config: \"rope_theta\" = 10000.0 and "
                                             "\"rope_parameters.rope_theta\" = 500000.0 disagree"));
  auto two_dicts = tiny();
  two_dicts.erase("rope_theta");
  two_dicts["rope_scaling"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  two_dicts["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  EXPECT_THAT(error_reading(two_dicts),
              HasSubstr("\"rope_scaling.rope_theta\" = 1000000.0 and "
                        "\"rope_parameters.rope_theta\" = 500000.0 disagree"));
}

TEST(Hf_Qwen3Config, RopeScalingIsRejectedByName) {
  for (const std::string type : {"yarn", "linear", "dynamic", "llama3", "longrope"}) {
    auto v4 = tiny();
    v4["rope_scaling"] = {
        {"rope_type", type}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
    EXPECT_THAT(error_reading(v4),
                AllOf(HasSubstr("\"rope_scaling.rope_type\" = \"" + type + "\" is invalid"),
                      HasSubstr("default RoPE only")));
    auto v5 = tiny();
    v5.erase("rope_theta");
    v5["rope_parameters"] = {{"rope_type", type}, {"rope_theta", 1e6}, {"factor", 4.0}};
    EXPECT_THAT(error_reading(v5),
                HasSubstr("\"rope_parameters.rope_type\" = \"" + type + "\" is invalid"));
  }
  auto legacy = tiny();
  legacy["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_THAT(error_reading(legacy), HasSubstr("\"rope_scaling.type\" = \"linear\" is invalid"));
  auto extra = tiny();
  extra["rope_parameters"] = {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}};
  EXPECT_THAT(error_reading(extra),
              HasSubstr("\"rope_parameters.partial_rotary_factor\" = 0.5 is invalid"));
}

TEST(Hf_Qwen3Config, KeysThatChangeTheModelPassOnlyWithWhatD9dComputes) {
  const std::vector<std::pair<std::string, nlohmann::json>> rejected = {
      {"attention_bias", true},
      {"hidden_act", "gelu"},
      {"attention_dropout", 0.1},
      {"use_sliding_window", true},
      {"model_type", "qwen3_moe"},
      {"quantization_config", {{"quant_method", "fp8"}}},
      {"auto_map", {{"AutoModelForCausalLM", "modeling.MyQwen3"}}},
      {"pruned_heads", {{"0", {1}}}},
      {"is_encoder_decoder", true},
      {"cross_attention_hidden_size", 16},
  };
  for (const auto& [key, value] : rejected) {
    auto json = tiny();
    json[key] = value;
    EXPECT_THAT(error_reading(json),
                HasSubstr("d9d Qwen3 config: \"" + key + "\" = " + value.dump() + " is invalid"));
  }
  auto sliding = tiny();
  sliding["layer_types"] = {"full_attention", "sliding_attention"};
  EXPECT_THAT(error_reading(sliding),
              HasSubstr("\"layer_types[1]\" = \"sliding_attention\" is invalid"));
  sliding["layer_types"] = {"full_attention", "full_attention", "full_attention"};
  EXPECT_THAT(error_reading(sliding), HasSubstr("it has 3 entries, one per layer expected"));
  // The values d9d computes with pass, as do the sliding-window keys without a sliding window.
  auto same = tiny();
  same.update(nlohmann::json::parse(R"({"attention_bias": false, "hidden_act": "silu",
      "attention_dropout": 0, "use_sliding_window": false, "sliding_window": 4096,
      "max_window_layers": 28, "layer_types": ["full_attention", "full_attention"],
      "model_type": "qwen3", "quantization_config": null, "pruned_heads": {}})"));
  EXPECT_EQ(read(same).num_hidden_layers, 2);
}

TEST(Hf_Qwen3Config, UnknownKeysAreRejectedWithASuggestion) {
  auto typo = tiny();
  typo["hiden_size"] = typo["hidden_size"];
  typo.erase("hidden_size");
  EXPECT_THAT(error_reading(typo),
              AllOf(HasSubstr("d9d Qwen3 config: unknown key \"hiden_size\" (did you mean "
                              "\"hidden_size\"?)"),
                    HasSubstr("d9d reads vocab_size, hidden_size")));
  auto two = tiny();
  two["rope_thetta"] = 1e6;
  two["flash_attention"] = true;
  EXPECT_THAT(error_reading(two), HasSubstr("unknown keys \"flash_attention\", \"rope_thetta\" "
                                            "(did you mean \"rope_theta\"?)"));
}

TEST(Hf_Qwen3Config, MissingKeysAreNamedAndEmptyIsNotAConfig) {
  auto json = tiny();
  json.erase("hidden_size");
  json["head_dim"] = nullptr;  // null counts as absent
  EXPECT_THAT(error_reading(json),
              HasSubstr("d9d Qwen3 config: missing required keys \"hidden_size\", \"head_dim\";"));
  auto no_theta = tiny();
  no_theta.erase("rope_theta");
  no_theta["rope_parameters"] = {{"rope_type", "default"}};
  EXPECT_THAT(error_reading(no_theta),
              HasSubstr("missing required key \"rope_theta\" (at the top level as transformers 4 "
                        "writes it, or in \"rope_parameters\" as transformers 5 does)"));
  EXPECT_THAT(error_reading(std::string("{}")),
              HasSubstr("missing required keys \"vocab_size\", \"hidden_size\", "
                        "\"intermediate_size\", \"num_hidden_layers\", \"num_attention_heads\", "
                        "\"num_key_value_heads\", \"head_dim\", \"rms_norm_eps\", \"rope_theta\""));
  EXPECT_THAT(error_reading(std::string("[1]")), HasSubstr("expected a JSON object"));
}

TEST(Hf_Qwen3Config, NumbersAreRangeChecked) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("vocab_size": 4294967297)",
       R"("vocab_size" = 4294967297 is invalid; expected an integer from 1 to 2147483647)"},
      {R"("vocab_size": 18446744073709551615)",
       R"("vocab_size" = 18446744073709551615 is invalid)"},
      {R"("num_hidden_layers": 0)", R"("num_hidden_layers" = 0 is invalid)"},
      {R"("hidden_size": -32)", R"("hidden_size" = -32 is invalid)"},
      {R"("hidden_size": 32.0)", R"("hidden_size" = 32.0 is invalid; expected an integer)"},
      {R"("hidden_size": "32")", R"("hidden_size" = "32" is invalid)"},
      {R"("hidden_size": 1e999)", "number overflow"},
      {R"("rope_theta": 1e999)", "number overflow"},
      {R"("rope_theta": -1)", R"("rope_theta" = -1 is invalid; expected a finite number > 0)"},
      {R"("rope_theta": "1e6")", R"("rope_theta" = "1e6" is invalid)"},
      {R"("rms_norm_eps": 0)", R"("rms_norm_eps" = 0 is invalid)"},
      {R"("tie_word_embeddings": 1)",
       R"("tie_word_embeddings" = 1 is invalid; expected true or false)"},
      {R"("max_position_embeddings": 4294967296)",
       R"("max_position_embeddings" = 4294967296 is invalid)"},
  };
  for (const auto& [entry, message] : bad) {
    // Appended after the valid keys: the later value is the one under test. Keys given twice are
    // an error of their own, so the valid one is dropped first.
    auto json = tiny();
    json.erase(entry.substr(1, entry.find('"', 1) - 1));
    std::string text = json.dump();
    text.back() = ',';
    text += entry + "}";
    EXPECT_THAT(error_reading(text), HasSubstr(message)) << text;
  }
  std::string twice = tiny().dump();
  twice.back() = ',';
  twice += R"("rope_theta": 500000.0})";
  EXPECT_THAT(error_reading(twice), HasSubstr("\"rope_theta\" appears twice in the JSON object"));
}

TEST(Hf_Qwen3Config, OptionalKeysHaveTransformersDefaults) {
  const auto config = read(tiny());
  EXPECT_FALSE(config.tie_word_embeddings);  // transformers' Qwen3Config: tie_word_embeddings=False
  EXPECT_EQ(config.max_position_embeddings, 32768);
  EXPECT_EQ(config.initializer_range, 0.02);
  auto tied = tiny();
  tied["tie_word_embeddings"] = true;
  EXPECT_TRUE(read(tied).tie_word_embeddings);
}

// Every key transformers 4.57.1 and 5.17.0 write for a Qwen3 config (to_dict without the diff
// against the defaults, from make_fixtures.py) is known to the reader, and a Hub config as
// published for Qwen/Qwen3-0.6B loads.
TEST(Hf_Qwen3Config, EveryKeyTransformersWritesIsKnown) {
  for (const char* file :
       {"configs/transformers-4.57.1-full.json", "configs/transformers-5.17.0-full.json"}) {
    const auto text = d9d::model::read_text_file(fixture(file));
    const auto json = nlohmann::json::parse(text);
    EXPECT_GT(json.size(), 30U) << file;
    const auto config = d9d::model::Qwen3Config::from_json_text(text);
    EXPECT_EQ(config.hidden_size, 32) << file;
    EXPECT_EQ(config.rope_theta, 1e4) << file;
  }
  const auto hub = d9d::model::Qwen3Config::from_json_text(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  EXPECT_TRUE(hub.tie_word_embeddings);
  EXPECT_EQ(hub.rope_theta, 1e6);
  EXPECT_EQ(hub.parameter_count(), 596049920);  // Qwen3-0.6B: 0.6B with the tied head
}

TEST(Hf_Qwen3Config, OurExportReadsBackToTheSameConfig) {
  auto json = tiny();
  json.update(nlohmann::json::parse(R"({"rope_theta": 123456.0, "tie_word_embeddings": true,
      "max_position_embeddings": 100, "initializer_range": 0.01})"));
  const auto config = read(json);
  const auto again = d9d::model::Qwen3Config::from_json_text(config.to_hf_json("bfloat16"));
  EXPECT_EQ(nlohmann::json::parse(again.to_hf_json("bfloat16")),
            nlohmann::json::parse(config.to_hf_json("bfloat16")));
  EXPECT_EQ(again.rope_theta, 123456.0);
  EXPECT_TRUE(again.tie_word_embeddings);
  EXPECT_EQ(again.max_position_embeddings, 100);
  EXPECT_EQ(again.initializer_range, 0.01);
}

}  // namespace
