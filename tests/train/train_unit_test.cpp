// Single-process tests of the training pieces: LR schedules, config validation (a matrix of bad
// configs), the Qwen3 model, and the trainer itself (gradient accumulation, outputs on disk).
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numbers>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adamw.h>

#include <d9d/core/detail/gradient_home.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/optim/adamw.hpp>
#include <d9d/optim/lr_schedule.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/detail/run_log.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/error_of.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::optim::Curve;
using d9d::optim::Phase;
using d9d::optim::PiecewiseSchedule;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ------------------------------------------------------------------------------------------------
// LR schedule

TEST(Optim_PiecewiseSchedule, WarmupThenCosine) {
  const auto s = PiecewiseSchedule::build(
      {Phase{.length = {.steps = 10}, .curve = Curve::linear, .start = 0.0, .end = 1.0},
       Phase{.length = {.rest = true}, .curve = Curve::cosine, .start = 1.0, .end = 0.1}},
      110);
  EXPECT_EQ(s.lengths(), (std::vector<int64_t>{10, 100}));
  EXPECT_DOUBLE_EQ(s.multiplier(0), 0.0);
  EXPECT_DOUBLE_EQ(s.multiplier(5), 0.5);
  EXPECT_DOUBLE_EQ(s.multiplier(10), 1.0);
  EXPECT_NEAR(s.multiplier(60), 0.55, 1e-12);  // halfway down the cosine
  EXPECT_NEAR(s.multiplier(109), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.99)), 1e-12);
  EXPECT_DOUBLE_EQ(s.multiplier(500), 0.1);  // after the last phase: its end
}

TEST(Optim_PiecewiseSchedule, PercentPolynomialExponentialConstant) {
  const auto s = PiecewiseSchedule::build(
      {Phase{.length = {.percent = 10}, .curve = Curve::constant, .start = 0.5},
       Phase{.length = {.percent = 40},
             .curve = Curve::polynomial,
             .start = 1.0,
             .end = 0.0,
             .power = 2.0},
       Phase{.length = {.rest = true}, .curve = Curve::exponential, .start = 1.0, .end = 0.01}},
      200);
  EXPECT_EQ(s.lengths(), (std::vector<int64_t>{20, 80, 100}));
  EXPECT_DOUBLE_EQ(s.multiplier(7), 0.5);
  EXPECT_DOUBLE_EQ(s.multiplier(60), 0.25);    // (1 - 0.5)^2
  EXPECT_NEAR(s.multiplier(150), 0.1, 1e-12);  // geometric midpoint of 1 and 0.01
}

TEST(Optim_PiecewiseSchedule, BadPhasesAreRejected) {
  EXPECT_THROW((void)PiecewiseSchedule::build({Phase{.length = {.steps = 5, .rest = true}}}, 10),
               std::invalid_argument);
  EXPECT_THROW((void)PiecewiseSchedule::build({Phase{.length = {.steps = 11}}}, 10),
               std::invalid_argument);
  EXPECT_THROW((void)PiecewiseSchedule::build(
                   {Phase{.length = {.steps = 5}, .curve = Curve::exponential, .start = 0.0}}, 10),
               std::invalid_argument);
  EXPECT_DOUBLE_EQ(PiecewiseSchedule::build({}, 10).multiplier(3), 1.0);
}

// ------------------------------------------------------------------------------------------------
// Config: every bad config is rejected with a message naming its key

struct BadConfig {
  std::string name;
  std::string json;
  std::string message;
};

std::string base_config(const std::string& run, const std::string& batch, const std::string& rest) {
  return R"({"run": )" + run + R"(, "batch": )" + batch + rest + "}";
}

const std::string kRun = R"({"output_dir": "out", "total_steps": 10})";
const std::string kBatch =
    R"({"global_batch_size": 8, "microbatch_size": 2, "sequence_length": 16})";

class Train_Config_Bad : public ::testing::TestWithParam<BadConfig> {};

TEST_P(Train_Config_Bad, IsRejectedNamingTheKey) {
  try {
    (void)d9d::TrainerConfig::from_json_text(GetParam().json);
    FAIL() << "accepted: " << GetParam().json;
  } catch (const d9d::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(GetParam().message));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, Train_Config_Bad,
    ::testing::Values(
        BadConfig{"NotJson", "{run: 1", "not valid JSON"},
        BadConfig{"MissingOutputDir", base_config(R"({"total_steps": 10})", kBatch, ""),
                  "\"run.output_dir\" is required"},
        BadConfig{"ZeroSteps", base_config(R"({"output_dir": "o", "total_steps": 0})", kBatch, ""),
                  "\"run.total_steps\" = 0 is invalid: expected an integer from 1 to "
                  "9223372036854775807"},
        BadConfig{
            "NegativeMicrobatch",
            base_config(kRun,
                        R"({"global_batch_size": 8, "microbatch_size": -1, "sequence_length": 16})",
                        ""),
            "\"batch.microbatch_size\" = -1 is invalid"},
        BadConfig{
            "MisspelledKey",
            base_config(kRun,
                        R"({"global_batch_size": 8, "micro_batch_size": 2, "sequence_length": 16})",
                        ""),
            "unknown key \"batch.micro_batch_size\" (did you mean \"batch.microbatch_size\"?)"},
        BadConfig{"UnknownSection", base_config(kRun, kBatch, R"(, "optimiser": {})"),
                  "unknown key \"optimiser\" (did you mean \"optimizer\"?)"},
        BadConfig{"ZeroLearningRate", base_config(kRun, kBatch, R"(, "optimizer": {"lr": 0})"),
                  "\"optimizer.lr\" = 0 is invalid: expected a number > 0"},
        BadConfig{"BetaOfOne", base_config(kRun, kBatch, R"(, "optimizer": {"beta2": 1.0})"),
                  "\"optimizer.beta2\" = 1.0 is invalid"},
        BadConfig{"PhaseWithTwoLengths",
                  base_config(kRun, kBatch, R"(, "lr_schedule": [{"steps": 2, "rest": true}])"),
                  "\"lr_schedule\" is invalid: phase 0: give exactly one of steps"},
        BadConfig{"UnknownCurve",
                  base_config(kRun, kBatch, R"(, "lr_schedule": [{"steps": 2, "curve": "cosin"}])"),
                  "\"lr_schedule[0].curve\" = \"cosin\" is invalid: expected one of"},
        BadConfig{"PhasesLongerThanRun",
                  base_config(kRun, kBatch, R"(, "lr_schedule": [{"steps": 20}])"),
                  "more than the run's 10"},
        BadConfig{"NegativeClipping",
                  base_config(kRun, kBatch, R"(, "gradient_clipping": {"max_norm": -1})"),
                  "\"gradient_clipping.max_norm\" = -1 is invalid"},
        BadConfig{"FailureTimeoutBelowASecond",
                  base_config(R"({"output_dir": "o", "total_steps": 10, "failure_timeout_s": 0.5})",
                              kBatch, ""),
                  "\"run.failure_timeout_s\" = 0.5 is invalid: expected a number >= 1.000000"},
        BadConfig{
            "FailureTimeoutNotANumber",
            base_config(R"({"output_dir": "o", "total_steps": 10, "failure_timeout_s": "1m"})",
                        kBatch, ""),
            "\"run.failure_timeout_s\" = \"1m\" is invalid: expected a number >= 1"},
        BadConfig{"ZeroDegree", base_config(kRun, kBatch, R"(, "mesh": {"tp": 0})"),
                  "\"mesh.tp\" = 0 is invalid: expected an integer from 1 to 2147483647"},
        BadConfig{
            "ExportDtype", base_config(kRun, kBatch, R"(, "export": {"dtype": "fp16"})"),
            "\"export.dtype\" = \"fp16\" is invalid: expected one of \"float32\", \"bfloat16\""},
        BadConfig{"LoggingNotBool",
                  base_config(kRun, kBatch, R"(, "logging": {"progress": "yes"})"),
                  "\"logging.progress\" = \"yes\" is invalid: expected true or false"},
        BadConfig{"ModelNotObject", base_config(kRun, kBatch, R"(, "model": [1])"),
                  "\"model\" = [1] is invalid: expected a JSON object"},
        BadConfig{"KeyTwiceInModel",
                  base_config(kRun, kBatch, R"(, "model": {"rope_theta": 1e4, "rope_theta": 5e5})"),
                  "d9d config: \"model\": key \"rope_theta\" appears twice in its JSON object"},
        BadConfig{"SectionTwice", base_config(kRun, kBatch, R"(, "batch": {})"),
                  "d9d config: \"batch\" appears twice in the JSON object"},
        BadConfig{"NumberOverflow", base_config(kRun, kBatch, R"(, "optimizer": {"lr": 1e999})"),
                  "not valid JSON: bad JSON ([json.exception.out_of_range.406] number overflow"},
        // Integers beyond their type are errors, never truncated (2^32 + 1 is not pp = 1).
        BadConfig{"DegreeBeyondInt", base_config(kRun, kBatch, R"(, "mesh": {"pp": 4294967297})"),
                  "\"mesh.pp\" = 4294967297 is invalid: expected an integer from 1 to 2147483647"},
        BadConfig{
            "StepsBeyondInt64",
            base_config(R"({"output_dir": "o", "total_steps": 9223372036854775808})", kBatch, ""),
            "\"run.total_steps\" = 9223372036854775808 is invalid"},
        BadConfig{"SeedBeyondUint64",
                  base_config(R"({"output_dir": "o", "total_steps": 1, "seed": 1e20})", kBatch, ""),
                  "\"run.seed\" = 1e+20 is invalid: expected an integer from 0 to "},
        BadConfig{"NegativeSeed",
                  base_config(R"({"output_dir": "o", "total_steps": 1, "seed": -1})", kBatch, ""),
                  "\"run.seed\" = -1 is invalid"},
        BadConfig{"GraphsNegativeWarmup",
                  base_config(kRun, kBatch, R"(, "cuda_graphs": {"warmup_steps": -1})"),
                  "\"cuda_graphs.warmup_steps\" = -1 is invalid"},
        BadConfig{"GraphsMisspelled",
                  base_config(kRun, kBatch, R"(, "cuda_graphs": {"enable": true})"),
                  "unknown key \"cuda_graphs.enable\" (did you mean \"cuda_graphs.enabled\"?)"},
        BadConfig{"HugeSteps",
                  base_config(R"({"output_dir": "o", "total_steps": 1e999})", kBatch, ""),
                  "number overflow"}),
    [](const auto& info) { return info.param.name; });

// A command line's replacements (the quickstart's --data, --output, --steps, --pp) are applied
// after the strict parse and before validation, so they meet the same rules.
TEST(Train_Config, OverridesApplyBeforeValidation) {
  const auto text = base_config(kRun, kBatch, "");
  const auto cfg = d9d::TrainerConfig::from_json_text(
      text, {{"run.total_steps", "7"}, {"mesh.pp", "2"}, {"data.paths", R"(["a.bin"])"}});
  EXPECT_EQ(cfg.run.total_steps, 7);
  EXPECT_EQ(cfg.mesh.pp, 2);
  EXPECT_EQ(cfg.section("data"), R"({"paths":["a.bin"]})");
  const auto bad = [&](const std::string& key, const std::string& value) {
    return d9d::testing::error_of<d9d::ConfigError>([&] {
      (void)d9d::TrainerConfig::from_json_text(text, {{key, value}});
    });
  };
  EXPECT_THAT(bad("mesh.pp", "4294967297"),
              HasSubstr("\"mesh.pp\" = 4294967297 is invalid: expected an integer from 1 to "
                        "2147483647"));
  EXPECT_THAT(bad("run.seed", "nope"),
              HasSubstr("the value given for \"run.seed\" (nope) is not valid JSON"));
  EXPECT_THAT(bad("run.output_dir.x", "1"),
              HasSubstr("cannot set \"run.output_dir.x\": \"run.output_dir\" = \"out\" is not a "
                        "JSON object"));
  EXPECT_THAT(bad("run..x", "1"), HasSubstr("is not a dotted key"));
  EXPECT_THAT(bad("run.totl_steps", "1"), HasSubstr("unknown key \"run.totl_steps\""));
  // A key given twice in the text stays an error whatever the overrides.
  EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>([&] {
                (void)d9d::TrainerConfig::from_json_text(
                    base_config(kRun, kBatch, R"(, "batch": {})"), {{"run.total_steps", "3"}});
              }),
              HasSubstr("appears twice"));
}

TEST(Train_Config, GlobalBatchMustDivideByDataParallelTimesMicrobatch) {
  const auto cfg = d9d::TrainerConfig::from_json_text(base_config(kRun, kBatch, ""));
  EXPECT_EQ(cfg.microbatches_per_step(2), 2);
  try {
    cfg.check_against_data_parallel(3);
    FAIL();
  } catch (const d9d::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("\"batch.global_batch_size\" = 8 is not divisible by "
                                    "data-parallel ranks (3) x \"batch.microbatch_size\" (2) = 6. "
                                    "Fix: use a multiple of 6, e.g. 6 or 12"));
  }
}

TEST(Train_Config, DefaultsAndSections) {
  const auto cfg = d9d::TrainerConfig::from_json_text(base_config(
      kRun, kBatch,
      R"(, "gradient_clipping": {"max_norm": null}, "mesh": {"dp_shard": 2}, "model": {"hidden_size": 8})"));
  EXPECT_FALSE(cfg.gradient_clipping.max_norm.has_value());
  EXPECT_EQ(cfg.mesh.dp_shard, 2);
  EXPECT_FALSE(cfg.mesh.tp.has_value());
  EXPECT_EQ(cfg.section("model"), R"({"hidden_size":8})");
  EXPECT_EQ(cfg.section("data"), "{}");
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 3e-4);
  EXPECT_FALSE(cfg.run.failure_timeout_s.has_value());  // the context's own (60 s by default)
  const auto timed = d9d::TrainerConfig::from_json_text(base_config(
      R"({"output_dir": "o", "total_steps": 10, "failure_timeout_s": 90})", kBatch, ""));
  EXPECT_EQ(timed.run.failure_timeout_s, 90.0);
}

// ------------------------------------------------------------------------------------------------
// Qwen3

TEST(Model_Qwen3, ParametersAreNamedAndCountedLikeHuggingFace) {
  for (const bool tied : {false, true}) {
    const auto config =
        d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(tied));
    d9d::model::Qwen3ForCausalLM model(config);
    int64_t count = 0;
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) {
      count += item.value().numel();
      names.push_back(item.key());
    }
    // The module's tensors against the config's formula; the formula against transformers' count
    // of the same models: Hf_Qwen3.OurExportLoadsInTransformersWithTheSameLogits (tests/hf).
    EXPECT_EQ(count, config.parameter_count()) << "tied " << tied;
    EXPECT_THAT(names, ::testing::Contains("model.layers.1.self_attn.q_norm.weight"));
    EXPECT_THAT(names, ::testing::Contains("model.layers.0.mlp.gate_proj.weight"));
    EXPECT_THAT(names, ::testing::Contains("model.norm.weight"));
    EXPECT_EQ(std::count(names.begin(), names.end(), "lm_head.weight"), tied ? 0 : 1);
  }
}

TEST(Model_Qwen3, LogitsAreCausal) {
  torch::manual_seed(1);
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json()));
  const at::NoGradGuard no_grad;
  auto tokens = at::randint(64, {2, 12}, at::kLong);
  const auto logits = model(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 12, 64}));
  auto changed = tokens.clone();
  changed.narrow(1, 8, 4).fill_(3);  // only positions 8.. differ
  const auto other = model(changed);
  EXPECT_TRUE(at::allclose(logits.narrow(1, 0, 8), other.narrow(1, 0, 8), 1e-5, 1e-6));
  EXPECT_FALSE(at::allclose(logits.narrow(1, 8, 4), other.narrow(1, 8, 4)));
}

TEST(Model_Qwen3, LossIsTheSummedCrossEntropyOverKeptTokens) {
  const auto logits = at::randn({2, 3, 5});
  auto labels = at::randint(5, {2, 3}, at::kLong);
  labels[0][1] = -100;
  const auto loss = d9d::model::causal_lm_loss(logits, labels);
  EXPECT_EQ(loss.tokens.item<int64_t>(), 5);
  const auto log_probs = logits.log_softmax(-1);
  double expected = 0;
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 3; ++t) {
      if (labels[b][t].item<int64_t>() != -100) {
        expected -= log_probs[b][t][labels[b][t].item<int64_t>()].item<double>();
      }
    }
  }
  EXPECT_NEAR(loss.loss_sum.item<double>(), expected, 1e-4);
}

TEST(Model_Qwen3, ConfigErrorsNameTheKey) {
  std::string json = d9d::testing::tiny_qwen3_json();
  const std::string heads = R"("num_attention_heads": 4, "num_key_value_heads": 2)";
  ASSERT_NE(json.find(heads), std::string::npos);
  json.replace(json.find(heads), heads.size(),
               R"("num_attention_heads": 6, "num_key_value_heads": 4)");
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { (void)d9d::model::Qwen3Config::from_json_text(json); }),
              HasSubstr("\"num_key_value_heads\" = 4 is invalid; it must divide "
                        "num_attention_heads = 6"));
}

// The trainer's "model" section goes through the same reader as config.json: a typo, a missing
// key or an empty section stops the run with a config error naming it, like every other section.
TEST(Train_Config_Model, TyposMissingKeysAndAnEmptySectionAreConfigErrors) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +  // NOLINT
      "/model_section";
  const auto start = [&](const std::string& model) {
    return d9d::testing::error_of<d9d::ConfigError>([&] {
      d9d::Trainer<d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>>> run(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          d9d::TrainerConfig::from_json_text(
              base_config(R"({"output_dir": ")" + dir + R"(", "total_steps": 1})", kBatch,
                          R"(, "logging": {"progress": false, "jsonl": false,
                          "tensorboard": false}, "export": {"enabled": false}, "model": )" +
                              model)));
    });
  };
  std::string typo = d9d::testing::tiny_qwen3_json();
  typo.replace(typo.find("hidden_size"), 11, "hiden_size");
  EXPECT_THAT(start(typo), AllOf(HasSubstr("d9d Qwen3 config: unknown key \"hiden_size\" (did "
                                           "you mean \"hidden_size\"?)"),
                                 HasSubstr("(in the \"model\" section)")));
  std::string missing = d9d::testing::tiny_qwen3_json();
  missing.replace(missing.find(R"("head_dim": 8,)"), 14, "");
  EXPECT_THAT(start(missing), HasSubstr("missing required key \"head_dim\""));
  EXPECT_THAT(start("{}"), AllOf(HasSubstr("missing required keys \"vocab_size\""),
                                 HasSubstr("(in the \"model\" section)")));
  std::string yarn = d9d::testing::tiny_qwen3_json();
  yarn.replace(yarn.find('{'), 1, R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0},)");
  EXPECT_THAT(start(yarn), HasSubstr("\"rope_scaling.rope_type\" = \"yarn\" is invalid"));
  // Without the error the tiny model trains: the section itself is fine.
  EXPECT_EQ(start(d9d::testing::tiny_qwen3_json()), "no error");
  // Under a pipeline plan the provider's build_stage reads the section the same way.
  EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>(
                  [&] { (void)d9d::Qwen3Provider{}.build_stage({.config_json = typo}); }),
              HasSubstr("unknown key \"hiden_size\" (did you mean \"hidden_size\"?)"));
}

// Every example config of the repository still reads: the required keys are there.
TEST(Train_Config_Model, TheExampleConfigsRead) {
  const char* examples = std::getenv("D9D_EXAMPLES_DIR");
  for (const auto& [file, tied] : std::vector<std::pair<std::string, bool>>{
           {"03_qwen3_quickstart/quickstart.json", true},
           {"03_qwen3_quickstart/qwen3_0p6b_gpu.json", true},
           {"03_qwen3_quickstart/qwen3_0p6b_gpu_pp.json", false},
           {"03_qwen3_quickstart/qwen3_1p7b_gpu.json", true},
           {"03_qwen3_quickstart/qwen3_8b_gpu.json", false}}) {
    const auto cfg = d9d::TrainerConfig::from_file(
        d9d::files::join(examples != nullptr ? examples : "examples", file));
    const auto config = d9d::model::Qwen3Config::from_json_text(cfg.section("model"));
    EXPECT_EQ(config.tie_word_embeddings, tied) << file;
    EXPECT_GE(config.num_hidden_layers, 4) << file;
  }
}

// ------------------------------------------------------------------------------------------------
// Trainer, one process

// ---- the fused head + cross-entropy, and the fused AdamW
// ------------------------------------------

TEST(Model_LinearCrossEntropy, EqualsTheHeadThenTheLossInDouble) {
  at::manual_seed(8);
  const auto hidden = at::randn({37, 16}, at::kDouble).requires_grad_(true);
  const auto weight = at::randn({29, 16}, at::kDouble).requires_grad_(true);
  auto labels = at::randint(29, {37}, at::kLong);
  labels.index_put_({at::arange(0, 37, 5)}, -100);  // ignored rows
  const auto want = d9d::model::causal_lm_loss(at::linear(hidden, weight), labels);
  const auto want_grads = torch::autograd::grad({want.loss_sum * 0.7}, {hidden, weight});
  for (const int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{8}, int64_t{37}, int64_t{100}}) {
    const auto got = d9d::model::linear_cross_entropy(hidden, weight, labels, -100, chunk);
    EXPECT_NEAR(got.loss_sum.item<double>(), want.loss_sum.item<double>(), 1e-12) << chunk;
    EXPECT_EQ(got.tokens.item<int64_t>(), want.tokens.item<int64_t>());
    // The incoming gradient (0.7) scales the gradients computed in the forward pass.
    const auto grads = torch::autograd::grad({got.loss_sum * 0.7}, {hidden, weight});
    EXPECT_TRUE(at::allclose(grads[0], want_grads[0], 1e-12, 1e-12)) << "hidden, chunk " << chunk;
    EXPECT_TRUE(at::allclose(grads[1], want_grads[1], 1e-12, 1e-12)) << "weight, chunk " << chunk;
  }
  // Without gradients (evaluation) only the loss is computed.
  const at::NoGradGuard no_grad;
  EXPECT_NEAR(d9d::model::linear_cross_entropy(hidden, weight, labels).loss_sum.item<double>(),
              want.loss_sum.item<double>(), 1e-12);
}

TEST(Model_LogitsCrossEntropy, EqualsTheLossOfTheLogitsAndLeavesThemAlone) {
  // Whole logits [B, T, V] (a pipeline's last stage output): loss, tokens and the logits' gradient
  // under an incoming 0.7 equal causal_lm_loss's in double; in float32 to float32 rounding; the
  // caller's logits keep their values (the kernel writes over a copy).
  at::manual_seed(9);
  auto labels = at::randint(29, {3, 7}, at::kLong);
  labels.index_put_({0, at::arange(0, 7, 3)}, -100);  // ignored rows
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const double tol = dtype == at::kDouble ? 1e-12 : 2e-6;
    const auto logits = (at::randn({3, 7, 29}, at::kDouble) * 3).to(dtype).requires_grad_(true);
    const auto before = logits.detach().clone();
    const auto want = d9d::model::causal_lm_loss(logits, labels);
    const auto want_grad = torch::autograd::grad({want.loss_sum * 0.7}, {logits})[0];
    const auto got = d9d::model::logits_cross_entropy(logits, labels);
    EXPECT_TRUE(at::equal(logits.detach(), before));
    EXPECT_EQ(got.loss_sum.scalar_type(), want.loss_sum.scalar_type());
    EXPECT_NEAR(got.loss_sum.item<double>(), want.loss_sum.item<double>(),
                tol * std::abs(want.loss_sum.item<double>()));
    EXPECT_EQ(got.tokens.item<int64_t>(), 18);
    const auto grad = torch::autograd::grad({got.loss_sum * 0.7}, {logits})[0];
    EXPECT_EQ(grad.sizes(), logits.sizes());
    EXPECT_TRUE(at::allclose(grad, want_grad, tol, tol)) << dtype;
    EXPECT_TRUE(at::equal(grad.select(0, 0).select(0, 3), at::zeros({29}, dtype)));  // ignored
  }
  // Labels that do not match the rows are named.
  EXPECT_THAT(
      d9d::testing::error_of<std::invalid_argument>([] {
        (void)d9d::model::logits_cross_entropy(at::zeros({2, 5}), at::zeros({3}, at::kLong));
      }),
      testing::HasSubstr("one row per label"));
}

TEST(Model_SiluMulLinear, EqualsTheCompositionWithAndWithoutDeferredWeightGradients) {
  // down(silu(gate) * up) recomputing its input in backward: output and the gradients of gate, up
  // and W equal the composition's in float64 (to rounding), also with W's gradient deferred to a
  // d9d::WeightGradQueue.
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(3);
  const auto gate0 = at::randn({2, 5, 12}, f64);
  const auto up0 = at::randn({2, 5, 12}, f64);
  const auto weight0 = at::randn({7, 12}, f64);
  const auto grad_out = at::randn({2, 5, 7}, f64);
  const auto leaves = [&] {
    return std::vector<at::Tensor>{gate0.clone().requires_grad_(), up0.clone().requires_grad_(),
                                   weight0.clone().requires_grad_()};
  };
  auto want = leaves();
  const auto want_out = at::linear(at::silu(want[0]) * want[1], want[2]);
  want_out.backward(grad_out);
  for (const bool deferred : {false, true}) {
    auto got = leaves();
    d9d::WeightGradQueue queue;
    at::Tensor out;
    {
      const d9d::RecordWeightGrads record(queue);
      out = d9d::model::silu_mul_linear(got[0], got[1], got[2]);
    }
    {
      const d9d::DeferWeightGrads defer(queue);
      if (deferred) {
        out.backward(grad_out);
      }
    }
    if (deferred) {
      EXPECT_FALSE(got[2].grad().defined()) << "W's gradient waits for drain()";
      queue.drain();
    } else {
      out.backward(grad_out);
    }
    EXPECT_TRUE(at::allclose(out, want_out, 1e-12, 1e-12)) << deferred;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(got[i].grad().defined()) << i;
      EXPECT_TRUE(at::allclose(got[i].grad(), want[i].grad(), 1e-12, 1e-12))
          << "input " << i << ", deferred " << deferred;
    }
  }
}

TEST(Model_LowRankLinear, EqualsTheCompositionWithAndWithoutDeferredWeightGradients) {
  // x W^T + s (x A^T) B^T as one autograd function: output and the gradients of x, W, A and B
  // equal the composition's in float64 (to rounding), with the weight gradients computed at once
  // or deferred to a d9d::WeightGradQueue, and with W frozen (no gradient, as under LoRA).
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(5);
  const auto x0 = at::randn({2, 5, 12}, f64);
  const auto w0 = at::randn({7, 12}, f64);
  const auto a0 = at::randn({3, 12}, f64);
  const auto b0 = at::randn({7, 3}, f64);
  const auto grad_out = at::randn({2, 5, 7}, f64);
  constexpr double kScale = 0.75;
  for (const bool frozen : {false, true}) {
    const auto leaves = [&] {
      return std::vector<at::Tensor>{x0.clone().requires_grad_(),
                                     w0.clone().requires_grad_(!frozen),
                                     a0.clone().requires_grad_(), b0.clone().requires_grad_()};
    };
    auto want = leaves();
    const auto want_out =
        at::linear(want[0], want[1]) + at::linear(at::linear(want[0], want[2]), want[3]) * kScale;
    want_out.backward(grad_out);
    for (const bool deferred : {false, true}) {
      auto got = leaves();
      d9d::WeightGradQueue queue;
      at::Tensor out;
      {
        const d9d::RecordWeightGrads record(queue);
        out = d9d::model::low_rank_linear(got[0], got[1],
                                          {.a = got[2], .b = got[3], .scale = kScale});
      }
      {
        const d9d::DeferWeightGrads defer(queue);
        if (deferred) {
          out.backward(grad_out);
        }
      }
      if (deferred) {
        EXPECT_TRUE(got[0].grad().defined()) << "x's gradient comes at once";
        EXPECT_FALSE(got[2].grad().defined()) << "A's gradient waits for drain()";
        EXPECT_FALSE(got[3].grad().defined()) << "B's gradient waits for drain()";
        queue.drain();
      } else {
        out.backward(grad_out);
      }
      EXPECT_TRUE(at::allclose(out, want_out, 1e-12, 1e-12)) << deferred;
      for (int i = 0; i < 4; ++i) {
        if (i == 1 && frozen) {
          EXPECT_FALSE(got[1].grad().defined()) << "a frozen W gets no gradient";
          continue;
        }
        ASSERT_TRUE(got[i].grad().defined()) << i;
        EXPECT_TRUE(at::allclose(got[i].grad(), want[i].grad(), 1e-12, 1e-12))
            << "input " << i << ", deferred " << deferred << ", frozen W " << frozen;
      }
    }
  }
}

TEST(Model_FanOutLinear, EqualsEachLayersForwardWithAndWithoutDeferredWeightGradients) {
  // Three plain layers reading one x as one node: outputs and the gradients of x and the weights
  // equal the three layers' composition in float64 (to rounding), with the weight gradients at
  // once or deferred to a d9d::WeightGradQueue, with a frozen weight and an output that takes no
  // gradient (the third: neither its weight's gradient nor x's gets a term from it).
  at::manual_seed(6);
  const auto x0 = at::randn({2, 5, 12}, at::kDouble);
  const std::vector<int64_t> outs{7, 3, 4};
  std::vector<at::Tensor> w0;
  w0.reserve(outs.size());
  for (const auto out : outs) {
    w0.push_back(at::randn({out, 12}, at::kDouble));
  }
  const auto g0 = at::randn({2, 5, 7}, at::kDouble);
  const auto g1 = at::randn({2, 5, 3}, at::kDouble);
  const auto make_layers = [&] {
    std::vector<d9d::model::Linear> layers;
    for (size_t i = 0; i < outs.size(); ++i) {
      layers.emplace_back(12, outs[i]);
      layers.back()->to(at::kDouble);
      layers.back()->weight.set_data(w0[i].clone());
    }
    layers[1]->weight.requires_grad_(false);  // frozen
    return layers;
  };
  const auto want_x = x0.clone().requires_grad_();
  const auto want_layers = make_layers();
  std::vector<at::Tensor> want_out;
  want_out.reserve(want_layers.size());
  for (const auto& layer : want_layers) {
    want_out.push_back(at::linear(want_x, layer->weight));
  }
  ((want_out[0] * g0).sum() + (want_out[1] * g1).sum()).backward();
  for (const bool deferred : {false, true}) {
    const auto x = x0.clone().requires_grad_();
    auto layers = make_layers();
    d9d::WeightGradQueue queue;
    std::vector<at::Tensor> out;
    {
      const d9d::RecordWeightGrads record(queue);
      out = d9d::model::fan_out_linear(x, {layers[0].get(), layers[1].get(), layers[2].get()});
    }
    ASSERT_EQ(out.size(), 3U);
    ASSERT_EQ(out[0].grad_fn(), out[2].grad_fn()) << "one node";
    const auto loss = (out[0] * g0).sum() + (out[1] * g1).sum();
    if (deferred) {
      {
        const d9d::DeferWeightGrads defer(queue);
        loss.backward();
      }
      EXPECT_TRUE(x.grad().defined()) << "x's gradient comes at once";
      EXPECT_FALSE(layers[0]->weight.grad().defined()) << "the weight gradient waits for drain()";
      queue.drain();
    } else {
      loss.backward();
    }
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::allclose(out[i], want_out[i], 1e-12, 1e-12)) << i;
    }
    ASSERT_TRUE(x.grad().defined());
    EXPECT_TRUE(at::allclose(x.grad(), want_x.grad(), 1e-12, 1e-12)) << deferred;
    EXPECT_TRUE(at::allclose(layers[0]->weight.grad(), want_layers[0]->weight.grad(), 1e-12, 1e-12))
        << deferred;
    EXPECT_FALSE(layers[1]->weight.grad().defined()) << "frozen";
    EXPECT_FALSE(layers[2]->weight.grad().defined()) << "its output took no gradient";
  }
  // A layer with a bias is not plain: each layer runs its own forward (its own node), same values.
  d9d::model::Linear biased(12, 7, /*bias=*/true);
  biased->to(at::kDouble);
  const auto x = x0.clone().requires_grad_();
  auto layers = make_layers();
  const auto out = d9d::model::fan_out_linear(x, {layers[0].get(), biased.get()});
  EXPECT_NE(out[0].grad_fn(), out[1].grad_fn());
  EXPECT_TRUE(at::allclose(out[1], at::linear(x0, biased->weight, biased->bias), 1e-12, 1e-12));
}

// One backward of (y * g).sum(), y the layer on a copy of x0 through one of the library's linear
// paths (0: Linear, 1: fan_out_linear, 2: silu_mul_linear with `up`), recorded by `queue` (which
// never defers: the layers run their own autograd functions).
void linear_backward(int path, d9d::model::Linear& layer, const at::Tensor& x0,
                     const at::Tensor& up, const at::Tensor& g, d9d::WeightGradQueue& queue) {
  const auto x = x0.clone().requires_grad_();
  at::Tensor y;
  {
    const d9d::RecordWeightGrads record(queue);
    if (path == 0) {
      y = layer(x);
    } else if (path == 1) {
      y = d9d::model::fan_out_linear(x, {layer.get()})[0];
    } else {
      y = d9d::model::silu_mul_linear(x, up, layer->weight);
    }
  }
  (y * g).sum().backward();
}

// Counts the calls of a parameter's post-accumulate-grad hook (as the data-parallel reducers'
// readiness hooks are called).
class CountingHook : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit CountingHook(int& calls) : calls_(calls) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override { ++calls_; }

 private:
  int& calls_;
};

TEST(Model_Linear, AddsWeightGradientsIntoAnExistingGradientInPlace) {
  // A second backward adds the weight gradient into the existing .grad with the GEMM itself (the
  // same storage, the sum of both products) through Linear under a recording queue, fan_out_linear
  // and silu_mul_linear; under a post-accumulate-grad hook (the data-parallel reducers') too: the
  // .grad the GEMM added into is handed back to AccumulateGrad, which keeps it (a new tensor over
  // the same memory) and calls the hook once per backward; while something else holds .grad, or a
  // hook waits on the arriving gradient, autograd adds the product itself; autograd::grad of
  // chosen inputs leaves .grad alone.
  at::manual_seed(7);
  const auto x0 = at::randn({2, 5, 12}, at::kDouble);
  const auto up0 = at::randn({2, 5, 12}, at::kDouble);
  const auto g0 = at::randn({2, 5, 7}, at::kDouble);
  const auto g1 = g0 * -0.5 + 0.25;
  // The weight's gradient for one backward with output gradient g and input `in`.
  const auto product = [](const at::Tensor& g, const at::Tensor& in) {
    return g.reshape({-1, 7}).t().mm(in.reshape({-1, 12}));
  };
  // Hooks: none, a post-accumulate-grad hook (counted), a hook on the arriving gradient that
  // doubles it (it must see every product), the counted hook while the test holds .grad too.
  for (int path = 0; path < 3; ++path) {
    for (const int hooked : {0, 1, 2, 3}) {
      d9d::model::Linear layer(12, 7, false);
      layer->to(at::kDouble);
      int hook_calls = 0;
      if (hooked == 1 || hooked == 3) {
        torch::autograd::impl::set_post_acc_grad_hooks(layer->weight,
                                                       std::make_unique<CountingHook>(hook_calls));
      } else if (hooked == 2) {
        layer->weight.register_hook([](const at::Tensor& grad) { return grad * 2; });
      }
      d9d::WeightGradQueue queue;  // recording, never deferring
      const auto run = [&](const at::Tensor& g) {
        linear_backward(path, layer, x0, up0, g, queue);
      };
      const std::string where = "path " + std::to_string(path) + ", hook " + std::to_string(hooked);
      run(g0);
      ASSERT_TRUE(layer->weight.grad().defined()) << where;
      const auto* storage = layer->weight.grad().data_ptr();
      const auto* first = layer->weight.grad().unsafeGetTensorImpl();
      const auto held = hooked == 3 ? layer->weight.grad() : at::Tensor();
      run(g1);
      const auto in = path == 2 ? at::silu(x0) * up0 : x0;
      const auto want = (product(g0, in) + product(g1, in)) * (hooked == 2 ? 2.0 : 1.0);
      EXPECT_TRUE(at::allclose(layer->weight.grad(), want, 1e-12, 1e-12)) << where;
      EXPECT_EQ(layer->weight.grad().data_ptr(), storage) << where << ": accumulated in place";
      EXPECT_EQ(hook_calls, hooked == 1 || hooked == 3 ? 2 : 0) << where;
      EXPECT_EQ(layer->weight.grad().unsafeGetTensorImpl() != first, hooked == 1)
          << where << ": handed back to AccumulateGrad only under the hook alone";
      // autograd::grad of x alone: the weight's .grad stays as it was.
      const auto before = layer->weight.grad().clone();
      const auto x = x0.clone().requires_grad_();
      at::Tensor y;
      {
        const d9d::RecordWeightGrads record(queue);
        y = path == 2 ? d9d::model::silu_mul_linear(x, up0, layer->weight) : layer(x);
      }
      const auto dx = torch::autograd::grad({(y * g0).sum()}, {x})[0];
      EXPECT_TRUE(dx.defined()) << where;
      EXPECT_TRUE(at::equal(layer->weight.grad(), before)) << where << ": autograd::grad";
    }
  }
}

TEST(Model_Linear, AWeightUsedTwiceUnderAPostAccumulateHookSumsBothUses) {
  // Two uses of one weight in a backward (the layer on two inputs): the first use's GEMM adds into
  // the handed-back .grad, the second's product is added by the engine before AccumulateGrad; the
  // hook runs once per backward and sees both uses of both backwards.
  at::manual_seed(8);
  const auto a0 = at::randn({3, 12}, at::kDouble);
  const auto b0 = at::randn({3, 12}, at::kDouble);
  d9d::model::Linear layer(12, 7, false);
  layer->to(at::kDouble);
  int hook_calls = 0;
  torch::autograd::impl::set_post_acc_grad_hooks(layer->weight,
                                                 std::make_unique<CountingHook>(hook_calls));
  const auto ga = at::randn({3, 7}, at::kDouble);
  const auto gb = at::randn({3, 7}, at::kDouble);
  d9d::WeightGradQueue queue;  // recording, never deferring: the layer's autograd function
  for (int i = 0; i < 2; ++i) {
    at::Tensor y;
    {
      const d9d::RecordWeightGrads record(queue);
      y = layer(a0) * ga + layer(b0) * gb;
    }
    y.sum().backward();
  }
  const auto want = (ga.t().mm(a0) + gb.t().mm(b0)) * 2.0;
  EXPECT_TRUE(at::allclose(layer->weight.grad(), want, 1e-12, 1e-12));
  EXPECT_EQ(hook_calls, 2);
}

// Offers a place in a NaN-filled buffer for its parameter's gradient, once until reset (as
// Replicate's copy engine offers its buffer once per step), and counts its calls.
class HomeHook : public d9d::detail::GradientHome {
 public:
  HomeHook(at::Tensor buffer, int64_t offset, at::IntArrayRef sizes, int& calls, bool offers)
      : buffer_(std::move(buffer)),
        offset_(offset),
        sizes_(sizes.vec()),
        calls_(calls),
        offers_(offers) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override { ++calls_; }
  at::Tensor home() override {
    ++asked;
    if (!offers_ || handed) {
      return {};
    }
    handed = true;
    return at::empty({0}, buffer_.options()).set_(buffer_.storage(), offset_, sizes_);
  }
  int asked = 0;
  bool handed = false;

 private:
  at::Tensor buffer_;
  int64_t offset_;
  std::vector<int64_t> sizes_;
  int& calls_;
  bool offers_;
};

TEST(Model_Linear, WritesTheFirstWeightGradientIntoTheHomeItsHookOffers) {
  // Under a GradientHome hook (Replicate's copy engine), the first backward's weight-gradient GEMM
  // writes the product into the offered memory (NaNs there before: overwritten, not added) and
  // AccumulateGrad keeps that memory as .grad; the second adds into it in place; the hook runs
  // once per backward. Through Linear, fan_out_linear and silu_mul_linear. A weight used twice in
  // one backward takes the home once and sums both uses; a hook that offers nothing leaves
  // autograd's own gradient.
  at::manual_seed(9);
  const auto x0 = at::randn({2, 5, 12}, at::kDouble);
  const auto up0 = at::randn({2, 5, 12}, at::kDouble);
  const auto g0 = at::randn({2, 5, 7}, at::kDouble);
  const auto g1 = g0 * -0.5 + 0.25;
  const auto product = [](const at::Tensor& g, const at::Tensor& in) {
    return g.reshape({-1, 7}).t().mm(in.reshape({-1, 12}));
  };
  constexpr int64_t kOffset = 16;
  constexpr int64_t kNumel = int64_t{7} * 12;  // the weight's elements
  for (int path = 0; path < 3; ++path) {
    for (const bool offers : {true, false}) {
      const std::string where =
          "path " + std::to_string(path) + (offers ? ", offered" : ", not offered");
      d9d::model::Linear layer(12, 7, false);
      layer->to(at::kDouble);
      const auto buffer = at::full({kOffset + kNumel + 8}, std::nan(""), at::kDouble);
      int hook_calls = 0;
      auto owned =
          std::make_unique<HomeHook>(buffer, kOffset, layer->weight.sizes(), hook_calls, offers);
      auto* hook = owned.get();
      torch::autograd::impl::set_post_acc_grad_hooks(layer->weight, std::move(owned));
      d9d::WeightGradQueue queue;  // recording, never deferring
      const auto run = [&](const at::Tensor& g) {
        linear_backward(path, layer, x0, up0, g, queue);
      };
      const auto in = path == 2 ? at::silu(x0) * up0 : x0;
      run(g0);
      ASSERT_TRUE(layer->weight.grad().defined()) << where;
      EXPECT_TRUE(at::allclose(layer->weight.grad(), product(g0, in), 1e-12, 1e-12)) << where;
      EXPECT_EQ(layer->weight.grad().data_ptr() == buffer.data_ptr<double>() + kOffset, offers)
          << where << ": the first product lives in the home";
      EXPECT_EQ(hook->asked, 1) << where;
      run(g1);
      EXPECT_TRUE(
          at::allclose(layer->weight.grad(), product(g0, in) + product(g1, in), 1e-12, 1e-12))
          << where;
      EXPECT_EQ(layer->weight.grad().data_ptr() == buffer.data_ptr<double>() + kOffset, offers)
          << where << ": added in place";
      EXPECT_EQ(hook->asked, 1) << where << ": asked only while .grad is undefined";
      EXPECT_EQ(hook_calls, 2) << where;
      if (offers) {
        EXPECT_TRUE(at::isnan(buffer.narrow(0, 0, kOffset)).all().item<bool>()) << where;
        EXPECT_TRUE(at::isnan(buffer.narrow(0, kOffset + kNumel, 8)).all().item<bool>()) << where;
      }
    }
  }
  // Two uses of the weight in the first backward: one home, both uses summed.
  const auto a0 = at::randn({3, 12}, at::kDouble);
  const auto b0 = at::randn({3, 12}, at::kDouble);
  const auto ga = at::randn({3, 7}, at::kDouble);
  const auto gb = at::randn({3, 7}, at::kDouble);
  d9d::model::Linear layer(12, 7, false);
  layer->to(at::kDouble);
  const auto buffer = at::full({int64_t{7} * 12}, std::nan(""), at::kDouble);
  int hook_calls = 0;
  auto owned = std::make_unique<HomeHook>(buffer, 0, layer->weight.sizes(), hook_calls, true);
  auto* hook = owned.get();
  torch::autograd::impl::set_post_acc_grad_hooks(layer->weight, std::move(owned));
  d9d::WeightGradQueue queue;
  at::Tensor y;
  {
    const d9d::RecordWeightGrads record(queue);
    y = layer(a0) * ga + layer(b0) * gb;
  }
  y.sum().backward();
  EXPECT_TRUE(at::allclose(layer->weight.grad(), ga.t().mm(a0) + gb.t().mm(b0), 1e-12, 1e-12));
  EXPECT_EQ(hook->asked, 2);
  EXPECT_EQ(hook_calls, 1);
}

TEST(Model_Qwen3Loss, FusedAndUnfusedKernelsTrainAlike) {
  // The same run with the fused ops (rope, silu_mul, linear_cross_entropy) and without, in
  // float64: equal to rounding.
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  using Fp64Plan = d9d::Plan<d9d::precision::Fp64>;
  const auto train = [&](bool fused) {
    d9d::model::set_fused_kernels(fused);
    d9d::Trainer<Fp64Plan> run(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        d9d::testing::tiny_run("/tmp/d9d_fused" + std::to_string(fused), 4, 8, 4));
    auto result = run.train();
    d9d::model::set_fused_kernels(true);
    return result;
  };
  const auto fused = train(true);
  const auto plain = train(false);
  ASSERT_EQ(fused.losses.size(), plain.losses.size());
  for (std::size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_NEAR(fused.losses[i], plain.losses[i], 1e-10 * std::abs(plain.losses[i])) << i;
  }
}

TEST(Precision_Bf16Params, TrainAlongTheFloat32LossCurve) {
  // bfloat16 parameters without a master copy (stochastic rounding, float32 moments; and torch's
  // round-to-nearest AdamW) follow the float32 run's loss curve to bfloat16 tolerance, and learn.
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto train = [&]<class Precision>(Precision /*tag*/, const std::string& name) {
    d9d::Trainer<d9d::Plan<Precision>> run(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        d9d::testing::tiny_run("/tmp/d9d_precision_" + name, 30, 8, 4));
    return run.train();
  };
  const auto fp32 = train(d9d::precision::Fp32{}, "fp32");
  const auto sr = train(d9d::precision::Bf16Params<>{}, "sr");
  const auto nearest =
      train(d9d::precision::Bf16Params<d9d::precision::NearestRounding>{}, "nearest");
  ASSERT_EQ(fp32.losses.size(), sr.losses.size());
  ASSERT_EQ(fp32.losses.size(), nearest.losses.size());
  // bfloat16 keeps 8 significant bits (unit roundoff u = 2^-8). The first loss differs from
  // float32's by rounding alone (~1e-5 relative: the errors of 128 token losses average out); the
  // runs then drift apart as AdamW turns rounding-sized gradient differences into whole steps.
  // Bound: 2u = 0.78% at every step, a fourteenth of the 10.7% the loss falls in these 30 steps.
  // Measured: stochastic rounding <= 0.25%, nearest <= 0.41% (tests/parallel's
  // mixed_precision_multiprocess_test bounds the same precisions under the strategies).
  constexpr double kTwoU = 2.0 / 256;
  for (std::size_t i = 0; i < fp32.losses.size(); ++i) {
    EXPECT_NEAR(sr.losses[i], fp32.losses[i], kTwoU * fp32.losses[i]) << "step " << i;
    EXPECT_NEAR(nearest.losses[i], fp32.losses[i], kTwoU * fp32.losses[i]) << "step " << i;
  }
  // It learns: 30 steps take the float32 run from 4.16 to 3.72.
  EXPECT_LT(sr.losses.back(), 0.93 * sr.losses.front());
  EXPECT_LT(fp32.losses.back(), 0.93 * fp32.losses.front());
}

TEST(Optim_FusedAdamW, MatchesAdamWAndPicksUpARestoredStep) {
  at::manual_seed(9);
  const auto make = [] {
    std::vector<at::Tensor> params = {at::randn({5, 3}, at::kDouble).requires_grad_(true),
                                      at::randn({4}, at::kDouble).requires_grad_(true)};
    return params;
  };
  auto a = make();
  std::vector<at::Tensor> b;
  b.reserve(a.size());
  for (const auto& p : a) {
    b.push_back(p.detach().clone().requires_grad_(true));
  }
  const auto options = torch::optim::AdamWOptions(0.01).betas({0.9, 0.95}).weight_decay(0.1);
  torch::optim::AdamW reference(a, options);
  d9d::optim::FusedAdamW fused(b, options);
  for (int step = 0; step < 5; ++step) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto g = at::randn_like(a[i]);
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    reference.step();
    fused.step();
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::allclose(a[i], b[i], 1e-12, 1e-14))
        << i << " max diff " << (a[i] - b[i]).abs().max().item<double>();
    const auto& state =
        static_cast<torch::optim::AdamWParamState&>(*fused.state()[b[i].unsafeGetTensorImpl()]);
    EXPECT_EQ(state.step(), 5);
  }
  // A step count set from outside (a restored checkpoint) is what the next update's bias
  // correction uses: both optimizers at step 100 again agree.
  for (std::size_t i = 0; i < a.size(); ++i) {
    static_cast<torch::optim::AdamWParamState&>(*reference.state()[a[i].unsafeGetTensorImpl()])
        .step(100);
    static_cast<torch::optim::AdamWParamState&>(*fused.state()[b[i].unsafeGetTensorImpl()])
        .step(100);
    const auto g = at::randn_like(a[i]);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
  reference.step();
  fused.step();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::allclose(a[i], b[i], 1e-12, 1e-14)) << i;
  }
}

using LocalPlan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>>;

std::vector<at::Tensor> parameters_of(const d9d::detail::TrainerCore& core) {
  std::vector<at::Tensor> out;
  for (const auto& p : core.model()->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

TEST(Train_Trainer_Local, GradientAccumulationMatchesOneBigBatch) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp");  // NOLINT
  // float64: accumulation and one big batch differ only in summation order (tolerances derived in
  // tests/train/train_test_util.hpp).
  using Fp64Plan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Fp64>;
  d9d::Trainer<Fp64Plan> whole(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{},
                               d9d::testing::tiny_run(dir + "/whole", 5, 8, 8));
  d9d::Trainer<Fp64Plan> split(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{},
                               d9d::testing::tiny_run(dir + "/split", 5, 8, 2));
  const auto a = whole.train();
  const auto b = split.train();
  ASSERT_EQ(a.losses.size(), 5U);
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], d9d::testing::kLossRtol * std::abs(a.losses[i]))
        << "step " << i;
    EXPECT_NEAR(a.grad_norms[i], b.grad_norms[i], d9d::testing::kLossRtol * a.grad_norms[i])
        << "step " << i;
  }
  const auto pa = parameters_of(whole.core());
  const auto pb = parameters_of(split.core());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::allclose(pa[i], pb[i], 0.0, d9d::testing::kParameterAtol)) << "parameter " << i;
  }
}

TEST(Train_Trainer_Local, WritesMetricsTensorBoardAndTheModel) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +
      "/outputs";  // NOLINT
  d9d::Trainer<LocalPlan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                  d9d::CausalLmTask{},
                                  d9d::testing::tiny_run(dir, 5, 8, 4, /*outputs=*/true));
  std::vector<int64_t> seen;
  trainer.on<d9d::events::StepEnd>([&](const d9d::events::StepEnd& e) { seen.push_back(e.step); });
  const auto result = trainer.train();
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // metrics.jsonl: steps 0, 2, 4 (log_every 2, and the last step)
  std::ifstream metrics(result.metrics_path);
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    EXPECT_THAT(line, HasSubstr("\"train/loss\""));
    ++lines;
  }
  EXPECT_EQ(lines, 3);
  EXPECT_TRUE(d9d::files::is_directory(result.tensorboard_dir));
  // The exported weights are the model's, by Hugging Face names, with a config.json.
  const auto exported = d9d::state::load_safetensors(result.export_dir + "/model.safetensors");
  const auto params = trainer.core().model()->named_parameters();
  ASSERT_EQ(exported.size(), params.size());
  for (const auto& [name, tensor] : exported) {
    ASSERT_TRUE(params.contains(name)) << name;
    EXPECT_TRUE(at::equal(tensor, params[name].detach())) << name;
  }
  std::ifstream config(result.export_dir + "/config.json");
  std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"model_type\": \"qwen3\""));
  EXPECT_THAT(text, HasSubstr("\"num_key_value_heads\": 2"));
}

}  // namespace

namespace {

// Raised by a StepEnd handler to stop a run after a given step, as a crash would.
struct Stop : std::runtime_error {
  Stop() : std::runtime_error("stopped by the test") {}
};

d9d::TrainerConfig checkpointed(const std::string& dir, bool async, int64_t keep = 2) {
  auto cfg = d9d::testing::tiny_run(dir, 6, 8, 4);
  cfg.checkpoint.every = 3;
  cfg.checkpoint.keep = keep;
  cfg.checkpoint.async = async;
  cfg.checkpoint.dir = dir + "/checkpoints";
  return cfg;
}

std::string tmp_dir(const std::string& name) {
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +  // NOLINT
      "/" + name;
  d9d::files::remove_tree(dir);
  return dir;
}

// A tiny run of 3 steps (2 microbatches each) on one CPU rank with step 1 traced under
// "profile" (`operators` as given); returns the trace directory.
std::string run_traced(const std::string& name, bool operators) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto dir = tmp_dir(name);
  auto cfg = d9d::testing::tiny_run(dir, 3, 4, 2);
  cfg.profile.start = 1;
  cfg.profile.steps = 1;
  cfg.profile.dir = dir + "/trace";
  cfg.profile.operators = operators;
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              d9d::CausalLmTask{}, cfg);
  (void)run.train();
  return cfg.profile.dir;
}

// "profile": a Chrome trace of the chosen steps with the step's phases named, and a memory summary.
TEST(Train_Profile, TracesTheChosenStepsWithTheirPhases) {
  const auto dir = run_traced("profile", /*operators=*/true);
  std::ifstream trace(dir + "/rank-0.trace.json");
  ASSERT_TRUE(trace.good());
  const std::string text((std::istreambuf_iterator<char>(trace)), std::istreambuf_iterator<char>());
  for (const char* phase :
       {"d9d::step", "d9d::forward", "d9d::backward", "d9d::gradient_sync", "d9d::optimizer"}) {
    EXPECT_NE(text.find(phase), std::string::npos) << phase;
  }
  // One step traced: two forwards would mean the profiler ran past its step (2 microbatches each).
  std::size_t forwards = 0;
  for (auto at = text.find("\"d9d::forward\""); at != std::string::npos;
       at = text.find("\"d9d::forward\"", at + 1)) {
    ++forwards;
  }
  EXPECT_EQ(forwards, 2U);
  // A Chrome trace: one JSON document with its events.
  const auto json = nlohmann::json::parse(text);
  EXPECT_FALSE(json.at("traceEvents").empty());
  const auto memory = nlohmann::json::parse(std::ifstream(dir + "/rank-0.memory.json"));
  EXPECT_EQ(memory.at("steps"), nlohmann::json::array({1, 2}));
  // Per phase, the highest rise of allocated memory above the phase's start (CPU allocations are
  // in the trace too): forward keeps activations for backward, so it rises; one step traced.
  const auto& phases = memory.at("phases");
  EXPECT_EQ(phases.at("d9d::step").at("occurrences"), 1);
  EXPECT_EQ(phases.at("d9d::forward").at("occurrences"), 2);
  EXPECT_EQ(phases.at("d9d::backward").at("occurrences"), 2);
  EXPECT_EQ(phases.at("d9d::optimizer").at("occurrences"), 1);
  EXPECT_GT(phases.at("d9d::forward").at("peak_rise_bytes").get<int64_t>(), 0);
  EXPECT_GT(phases.at("d9d::step").at("peak_rise_bytes").get<int64_t>(), 0);
  // Host time per phase; no device work on CPU, so no launches and no device kernels.
  EXPECT_GT(phases.at("d9d::forward").at("host_ms").get<double>(), 0.0);
  EXPECT_GE(phases.at("d9d::step").at("host_ms").get<double>(),
            phases.at("d9d::forward").at("host_ms").get<double>());
  EXPECT_EQ(phases.at("d9d::forward").at("launches"), 0);
  EXPECT_EQ(memory.at("launches"), 0);
  EXPECT_EQ(memory.at("device_kernels"), 0);
}

// The rates are timed after the warm-up: the first step, and with CUDA graphs the eager warm-up
// steps and the capturing step, unless that would leave no step to time.
TEST(Train_Profile, RatesAreTimedAfterTheWarmUpAndTheCapture) {
  d9d::TrainerConfig cfg;
  cfg.run.total_steps = 30;
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 0), 0);
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 12), 12);  // resumed at step 12
  cfg.cuda_graphs.enabled = true;
  cfg.cuda_graphs.warmup_steps = 3;  // steps 0-2 eager, step 3 captures
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 0), 3);
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 12), 15);
  cfg.cuda_graphs.warmup_steps = 0;  // step 0 captures
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 0), 0);
  cfg.cuda_graphs.warmup_steps = 3;
  cfg.run.total_steps = 4;  // nothing after the capture: the first step alone
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 0), 0);
  cfg.run.total_steps = 5;
  EXPECT_EQ(d9d::detail::last_untimed_step(cfg, 0), 3);
}

// "operators": false keeps the phases and drops the per-operator and memory events (a light trace).
TEST(Train_Profile, WithoutOperatorsKeepsOnlyThePhases) {
  const auto dir = run_traced("profile_light", /*operators=*/false);
  const auto json = nlohmann::json::parse(std::ifstream(dir + "/rank-0.trace.json"));
  std::set<std::string> names;
  for (const auto& event : json.at("traceEvents")) {
    if (event.contains("name")) {
      names.insert(event.at("name").get<std::string>());
    }
  }
  for (const char* phase : {"d9d::step", "d9d::forward", "d9d::backward", "d9d::optimizer"}) {
    EXPECT_TRUE(names.contains(phase)) << phase;
  }
  for (const auto& name : names) {
    EXPECT_NE(name.rfind("aten::", 0), 0U) << name;
    EXPECT_NE(name, "[memory]");
  }
  const auto memory = nlohmann::json::parse(std::ifstream(dir + "/rank-0.memory.json"));
  EXPECT_EQ(memory.at("phases").at("d9d::forward").at("occurrences"), 2);
  EXPECT_EQ(memory.at("phases").at("d9d::forward").at("peak_rise_bytes"), 0);
}

// "cuda_graphs" needs a CUDA device and a gradient path without host code in backward (one rank);
// each rule is a ConfigError naming the fix. (Pipeline plans are refused by the trainer too.)
TEST(Train_CudaGraphs, NeedACudaDeviceAndNoHostCodeInBackward) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  auto cfg = d9d::testing::tiny_run(tmp_dir("graphs_cpu"), 2, 8, 4);
  EXPECT_FALSE(cfg.cuda_graphs.enabled);
  EXPECT_EQ(cfg.cuda_graphs.warmup_steps, 1);
  cfg.cuda_graphs.enabled = true;
  const auto message = d9d::testing::error_of<d9d::ConfigError>([&] {
    d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{}, cfg);
  });
  EXPECT_THAT(message, HasSubstr("\"cuda_graphs\": CUDA graphs capture work on a CUDA device; "
                                 "this run is on cpu"));
  // FullyShard gathers and frees its units from hooks, on one rank too.
  using ShardPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>>;
  EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>([&] {
                d9d::Trainer<ShardPlan> run(ctx, d9d::Qwen3Provider{},
                                            d9d::testing::RandomWindowsProvider{},
                                            d9d::CausalLmTask{}, cfg);
              }),
              AllOf(HasSubstr("runs host code"), HasSubstr("Fix:")));
}

// On a GPU: the replayed microbatches give the eager run's losses, gradient norms and parameters
// (float64: the same kernels in the same order, so only the order of atomic additions may differ,
// ~1e-16 relative; the training tests' float64 tolerances hold), and the step's forward and
// backward launch one graph per microbatch instead of hundreds of kernels (the profile's summary).
TEST(Train_CudaGraphs, ReplayedStepsEqualEagerSteps) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const auto ctx = d9d::DistributedContext::local({.device = "cuda"});
  using Fp64Plan = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Fp64>;
  struct Run {
    d9d::TrainResult result;
    std::vector<at::Tensor> parameters;
    nlohmann::json profile;
  };
  const auto train = [&](bool graphs) {
    const auto dir = tmp_dir(graphs ? "graphs_on" : "graphs_off");
    auto cfg = d9d::testing::tiny_run(dir, 5, 8, 2);  // 4 microbatches per step
    cfg.cuda_graphs.enabled = graphs;
    cfg.profile.start = 3;
    cfg.profile.dir = dir + "/trace";
    d9d::Trainer<Fp64Plan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{}, cfg);
    Run out{.result = run.train(), .parameters = parameters_of(run.core()), .profile = {}};
    out.profile = nlohmann::json::parse(std::ifstream(dir + "/trace/rank-0.memory.json"));
    return out;
  };
  const auto eager = train(false);
  const auto graphed = train(true);
  EXPECT_EQ(eager.result.graph_replays, 0);
  EXPECT_EQ(graphed.result.graph_replays, 4 * 4);  // steps 1 to 4 (step 0 warms up)
  ASSERT_EQ(graphed.result.losses.size(), eager.result.losses.size());
  for (std::size_t i = 0; i < eager.result.losses.size(); ++i) {
    EXPECT_NEAR(graphed.result.losses[i], eager.result.losses[i],
                d9d::testing::kLossRtol * std::abs(eager.result.losses[i]))
        << "step " << i;
    EXPECT_NEAR(graphed.result.grad_norms[i], eager.result.grad_norms[i],
                d9d::testing::kLossRtol * eager.result.grad_norms[i])
        << "step " << i;
  }
  for (std::size_t i = 0; i < eager.parameters.size(); ++i) {
    EXPECT_TRUE(at::allclose(graphed.parameters[i].cpu(), eager.parameters[i].cpu(), 0.0,
                             d9d::testing::kParameterAtol))
        << "parameter " << i;
  }
  const auto& replay = graphed.profile.at("phases").at("d9d::graph_replay");
  EXPECT_EQ(replay.at("occurrences"), 4);
  EXPECT_EQ(replay.at("launches"), 4);  // one cudaGraphLaunch per microbatch
  const auto& phases = eager.profile.at("phases");
  EXPECT_GT(phases.at("d9d::forward").at("launches").get<int64_t>() +
                phases.at("d9d::backward").at("launches").get<int64_t>(),
            100);
  EXPECT_LT(graphed.profile.at("launches").get<int64_t>(), eager.profile.at("launches"));
}

TEST(Train_Checkpoint, ResumedRunContinuesExactlyAsTheUninterruptedOne) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto straight_dir = tmp_dir("ckpt_straight");
  d9d::Trainer<LocalPlan> straight(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                   d9d::CausalLmTask{},
                                   d9d::testing::tiny_run(straight_dir, 6, 8, 4));
  const auto want = straight.train();
  const auto want_params = parameters_of(straight.core());

  for (const bool async : {false, true}) {
    const auto dir = tmp_dir(async ? "ckpt_async" : "ckpt_sync");
    {
      // Stops after step 4 (index 3): the checkpoint after 3 steps is complete, step 6 never comes.
      d9d::Trainer<LocalPlan> first(ctx, d9d::Qwen3Provider{},
                                    d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                    checkpointed(dir, async));
      first.on<d9d::events::StepEnd>([](const d9d::events::StepEnd& e) {
        if (e.step == 3) {
          throw Stop();
        }
      });
      EXPECT_THROW((void)first.train(), Stop);
    }
    // Synchronous saves complete at once. An asynchronous one completes at the first step
    // boundary where the writer is done (here: after step index 3, before the stop, unless the
    // writer was slower than a step); either way no later checkpoint exists.
    const bool saved = d9d::files::exists(dir + "/checkpoints/step-3/trainer.json");
    if (!async) {
      EXPECT_TRUE(saved);
    } else if (!saved) {
      // Not completed before the stop: the writer (joined when the trainer went) still wrote the
      // whole file into step-3.tmp. Either way the save happened.
      const d9d::state::SafetensorsFile written(dir + "/checkpoints/step-3.tmp/rank-0.safetensors");
      EXPECT_TRUE(written.contains("rng/cpu"));
    }
    EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-6")) << async;
    const int64_t from = saved ? 3 : 0;

    d9d::Trainer<LocalPlan> resumed(ctx, d9d::Qwen3Provider{},
                                    d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                    checkpointed(dir, async));
    const auto got = resumed.train();
    EXPECT_EQ(got.start_step, from) << async;
    EXPECT_EQ(got.resumed_from, saved ? dir + "/checkpoints/step-3" : "");
    EXPECT_EQ(got.checkpoint_dir, dir + "/checkpoints/step-6");
    ASSERT_EQ(got.losses.size(), static_cast<std::size_t>(6 - from));
    for (std::size_t i = 0; i < got.losses.size(); ++i) {
      // Same process, same order of operations: bit-identical (model, AdamW state, data, LR).
      const auto step = i + static_cast<std::size_t>(from);
      EXPECT_EQ(got.losses[i], want.losses[step]) << "async " << async << " step " << step;
    }
    const auto got_params = parameters_of(resumed.core());
    for (std::size_t i = 0; i < want_params.size(); ++i) {
      EXPECT_TRUE(at::equal(got_params[i], want_params[i])) << "parameter " << i;
    }
    // A finished run resumes at its end and runs nothing.
    d9d::Trainer<LocalPlan> again(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                  d9d::CausalLmTask{}, checkpointed(dir, async));
    const auto none = again.train();
    EXPECT_EQ(none.start_step, 6);
    EXPECT_TRUE(none.losses.empty());
  }
}

TEST(Train_Checkpoint, KeepsTheLastKAndIgnoresHalfWrittenOnes) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto dir = tmp_dir("ckpt_keep");
  auto cfg = checkpointed(dir, /*async=*/true, /*keep=*/1);
  cfg.checkpoint.every = 2;  // saves after steps 2, 4 and 6
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              d9d::CausalLmTask{}, cfg);
  (void)run.train();
  EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-2"));
  EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-4"));
  EXPECT_TRUE(d9d::files::exists(dir + "/checkpoints/step-6/rank-0.safetensors"));
  // What crashes during saves leave: .tmp directories with partial files. They are not read, and
  // the next save removes those of every step (not other files).
  for (const auto* step : {"step-8.tmp", "step-5.tmp", "step-123.tmp"}) {
    d9d::files::create_directories(dir + "/checkpoints/" + step);
    std::ofstream(dir + "/checkpoints/" + step + "/rank-0.safetensors") << "partial";
  }
  std::ofstream(dir + "/checkpoints/notes.tmp") << "mine";
  auto longer = cfg;
  longer.run.total_steps = 8;
  d9d::Trainer<LocalPlan> resumed(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                  d9d::CausalLmTask{}, longer);
  const auto result = resumed.train();
  EXPECT_EQ(result.start_step, 6);
  EXPECT_EQ(result.losses.size(), 2U);
  EXPECT_EQ(result.checkpoint_dir, dir + "/checkpoints/step-8");
  EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-8.tmp"));
  EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-5.tmp"));
  EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-123.tmp"));
  EXPECT_TRUE(d9d::files::exists(dir + "/checkpoints/notes.tmp"));
}

TEST(Train_Checkpoint, ErrorsNameTheProblem) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const auto dir = tmp_dir("ckpt_errors");
  d9d::files::create_directories(dir + "/checkpoints");
  std::ofstream(dir + "/checkpoints/checkpoints.json") << "[1, 2]";
  EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] {
                d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{},
                                            d9d::testing::RandomWindowsProvider{},
                                            d9d::CausalLmTask{}, checkpointed(dir, false));
              }),
              HasSubstr("is not a checkpoint index"));
  // A checkpoint of another model: the missing parameter is named.
  const auto other = tmp_dir("ckpt_other");
  {
    auto cfg = checkpointed(other, false);
    cfg.run.total_steps = 3;
    d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{}, cfg);
    (void)run.train();
  }
  auto deeper = d9d::TrainerConfig::from_json_text(R"({"run": {"output_dir": ")" + other +
                                                   R"(", "total_steps": 6, "seed": 5},
          "batch": {"global_batch_size": 8, "microbatch_size": 4, "sequence_length": 16},
          "export": {"enabled": false}, "logging": {"progress": false, "jsonl": false,
          "tensorboard": false}, "model": )" + d9d::testing::tiny_qwen3_json(false, 3) +
                                                   "}");
  EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] {
                d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{},
                                            d9d::testing::RandomWindowsProvider{},
                                            d9d::CausalLmTask{}, deeper);
              }),
              HasSubstr("has no parameter \"model.layers.2."));
  // A corrupt trainer.json is named, not a bare JSON error.
  {
    const auto broken = tmp_dir("ckpt_broken");
    auto cfg = checkpointed(broken, false);
    cfg.run.total_steps = 3;
    d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{}, cfg);
    (void)run.train();
    std::ofstream(broken + "/checkpoints/step-3/trainer.json")
        << R"({"step": 3, "world_size": -2})";
    EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] {
                  d9d::Trainer<LocalPlan> again(ctx, d9d::Qwen3Provider{},
                                                d9d::testing::RandomWindowsProvider{},
                                                d9d::CausalLmTask{}, cfg);
                }),
                HasSubstr("/checkpoints/step-3/trainer.json\" is not a checkpoint's trainer.json "
                          "(step 3, world_size -2)"));
    std::ofstream(broken + "/checkpoints/step-3/trainer.json") << "{\"step\": ";
    EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] {
                  d9d::Trainer<LocalPlan> again(ctx, d9d::Qwen3Provider{},
                                                d9d::testing::RandomWindowsProvider{},
                                                d9d::CausalLmTask{}, cfg);
                }),
                HasSubstr("is not a checkpoint's trainer.json ([json.exception.parse_error"));
  }
  // resume_from must name a complete checkpoint.
  auto elsewhere = checkpointed(tmp_dir("ckpt_elsewhere"), false);
  elsewhere.checkpoint.resume_from = other;  // the run's directory, not one of its step-<N>
  EXPECT_THAT(d9d::testing::error_of<std::runtime_error>([&] {
                d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{},
                                            d9d::testing::RandomWindowsProvider{},
                                            d9d::CausalLmTask{}, elsewhere);
              }),
              HasSubstr("is not a complete checkpoint (no trainer.json). Fix: point "
                        "\"checkpoint.resume_from\" at a step-<N> directory"));
}

// ------------------------------------------------------------------------------------------------
// Numerical faults: a NaN or infinite loss or gradient norm never reaches the optimizer.

// Keeps the parameters as they are at the end of step `step` in `out`.
void snapshot_at(d9d::Trainer<LocalPlan>& trainer, int64_t step, std::vector<at::Tensor>& out) {
  trainer.on<d9d::events::StepEnd>([&trainer, &out, step](const d9d::events::StepEnd& e) {
    if (e.step == step) {
      out = parameters_of(trainer.core());
    }
  });
}

bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size() || a.empty()) {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) {
      return false;
    }
  }
  return true;
}

TEST(Train_Numerics, NanLossStopsNamingTheStepAndKeepsTheLastCheckpoint) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  for (const bool async : {false, true}) {
    const auto dir = tmp_dir(async ? "nan_stop_async" : "nan_stop_sync");
    const auto cfg = checkpointed(dir, async);  // 6 steps, a checkpoint after 3
    const d9d::testing::FaultyTask task{
        .first = 4, .last = 4, .factor = std::numeric_limits<double>::quiet_NaN()};
    d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                task, cfg);
    task.follow(run);
    std::vector<at::Tensor> good;  // after step index 3, the last finite one
    snapshot_at(run, 3, good);
    bool ended = false;
    run.on<d9d::events::StepEnd>([&](const d9d::events::StepEnd& e) { ended = e.step >= 4; });
    const auto error = d9d::testing::error_of<d9d::NumericalError>([&] { (void)run.train(); });
    EXPECT_THAT(error, HasSubstr("step 5 of 6 (index 4): loss nan")) << error;
    EXPECT_THAT(error, HasSubstr("the last checkpoint, " + dir + "/checkpoints/step-3, is kept"))
        << error;
    EXPECT_THAT(error, HasSubstr("\"numerics.on_nonfinite\": \"skip\"")) << error;
    EXPECT_FALSE(ended);  // stopped inside step 4
    // The optimizer never saw the NaN: the parameters are those after step index 3.
    EXPECT_TRUE(all_equal(parameters_of(run.core()), good)) << async;
    // The asynchronous save of step 3 was completed before the stop; nothing later exists.
    EXPECT_TRUE(d9d::files::exists(dir + "/checkpoints/step-3/trainer.json")) << async;
    EXPECT_FALSE(d9d::files::exists(dir + "/checkpoints/step-6")) << async;
    std::ifstream index(dir + "/checkpoints/checkpoints.json");
    const auto json = nlohmann::json::parse(index);
    EXPECT_THAT(json.dump(), HasSubstr("step-3")) << json.dump();
  }
  // Without checkpoints the message says so.
  const auto dir = tmp_dir("inf_stop");
  const d9d::testing::FaultyTask task{
      .first = 1, .last = 1, .factor = std::numeric_limits<double>::infinity()};
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              task, d9d::testing::tiny_run(dir, 4, 8, 4));
  task.follow(run);
  const auto error = d9d::testing::error_of<d9d::NumericalError>([&] { (void)run.train(); });
  EXPECT_THAT(error, HasSubstr("step 2 of 4 (index 1): loss inf")) << error;
  EXPECT_THAT(error, HasSubstr("no checkpoint was written")) << error;
}

TEST(Train_Numerics, AStepWithoutTargetTokensStopsNamingIt) {
  // The total weight is read with the loss and the norm in the step's one wait for the device;
  // a step without target tokens stops there, before the optimizer.
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const d9d::testing::FaultyTask task{.first = 2, .last = 2, .no_targets = true};
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              task, d9d::testing::tiny_run(tmp_dir("no_targets"), 4, 8, 4));
  task.follow(run);
  std::vector<at::Tensor> before;  // after step index 1
  snapshot_at(run, 1, before);
  const auto error = d9d::testing::error_of<std::runtime_error>([&] { (void)run.train(); });
  EXPECT_THAT(error, HasSubstr("step 2 has a total loss weight of 0.000000 (no target tokens on "
                               "any rank?)"))
      << error;
  EXPECT_TRUE(all_equal(parameters_of(run.core()), before));
}

TEST(Train_Numerics, InfiniteGradientNormSkipsTheStepWhenConfigured) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  auto cfg = d9d::testing::tiny_run(tmp_dir("inf_skip"), 5, 8, 4);
  cfg.numerics.on_nonfinite = "skip";
  // The gradients alone are infinite at step index 2 (the loss stays finite).
  const d9d::testing::FaultyTask task{.first = 2,
                                      .last = 2,
                                      .factor = std::numeric_limits<double>::infinity(),
                                      .gradient_only = true};
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              task, cfg);
  task.follow(run);
  std::vector<at::Tensor> before;
  std::vector<at::Tensor> skipped;
  std::vector<at::Tensor> after;
  snapshot_at(run, 1, before);
  snapshot_at(run, 2, skipped);
  snapshot_at(run, 3, after);
  int optimizer_steps = 0;
  run.on<d9d::events::AfterOptimizer>([&](const auto&) { ++optimizer_steps; });
  const auto result = run.train();
  EXPECT_EQ(result.skipped_steps, (std::vector<int64_t>{2}));
  ASSERT_EQ(result.losses.size(), 5U);
  EXPECT_TRUE(std::isfinite(result.losses[2]));
  EXPECT_FALSE(std::isfinite(result.grad_norms[2]));
  EXPECT_EQ(optimizer_steps, 4);
  // Step 2 left the parameters exactly as step 1 did; step 3 trained again, to finite values.
  EXPECT_TRUE(all_equal(skipped, before));
  EXPECT_FALSE(all_equal(after, before));
  for (const auto& p : parameters_of(run.core())) {
    EXPECT_TRUE(at::isfinite(p).all().item<bool>());
  }
}

TEST(Train_Numerics, TooManySkippedStepsInARowStop) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  auto cfg = d9d::testing::tiny_run(tmp_dir("nan_skips"), 8, 8, 4);
  cfg.numerics.on_nonfinite = "skip";
  cfg.numerics.max_consecutive_skips = 2;
  const d9d::testing::FaultyTask task{
      .first = 1, .last = 100, .factor = std::numeric_limits<double>::quiet_NaN()};
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              task, cfg);
  task.follow(run);
  const auto error = d9d::testing::error_of<d9d::NumericalError>([&] { (void)run.train(); });
  EXPECT_THAT(error, HasSubstr("step 4 of 8 (index 3): loss nan")) << error;
  EXPECT_THAT(error,
              HasSubstr("3 such steps in a row, more than \"numerics.max_consecutive_skips\" = 2"))
      << error;
}

TEST(Train_Numerics, LossSpikesAreReported) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  auto cfg = d9d::testing::tiny_run(tmp_dir("spike"), 8, 8, 4);
  cfg.numerics.loss_spike_window = 3;
  // Step 5's loss is 10 times what it would be (~4.2, about ln 64 for this model and data); the
  // others stay within a few percent of each other, far below 3 times their mean.
  const d9d::testing::FaultyTask task{.first = 5, .last = 5, .factor = 10.0};
  d9d::Trainer<LocalPlan> run(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                              task, cfg);
  task.follow(run);
  std::vector<d9d::events::LossSpike> spikes;
  run.on<d9d::events::LossSpike>([&](const d9d::events::LossSpike& e) { spikes.push_back(e); });
  const auto result = run.train();
  EXPECT_EQ(result.loss_spikes, (std::vector<int64_t>{5}));
  EXPECT_TRUE(result.skipped_steps.empty());
  ASSERT_EQ(spikes.size(), 1U);
  EXPECT_EQ(spikes[0].step, 5);
  EXPECT_EQ(spikes[0].loss, result.losses[5]);
  EXPECT_DOUBLE_EQ(spikes[0].mean, (result.losses[2] + result.losses[3] + result.losses[4]) / 3.0);

  // The same run with a floor above step 5's rise (~38 over a mean of ~4.2): no spike.
  cfg.run.output_dir = tmp_dir("spike_floor");
  cfg.numerics.loss_spike_min_rise = 50.0;
  d9d::Trainer<LocalPlan> floored(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                  task, cfg);
  task.follow(floored);
  const auto quiet = floored.train();
  EXPECT_TRUE(quiet.loss_spikes.empty());
  EXPECT_NEAR(quiet.losses[5], result.losses[5], 1e-9 * result.losses[5]);
}

TEST(Train_Config_Numerics, KeysAreReadAndChecked) {
  const auto cfg = d9d::TrainerConfig::from_json_text(
      base_config(kRun, kBatch,
                  R"(, "numerics": {"on_nonfinite": "skip", "max_consecutive_skips": 3,
                        "loss_spike_factor": 2.5, "loss_spike_window": 7,
                        "loss_spike_min_rise": 0.5})"));
  EXPECT_EQ(cfg.numerics.on_nonfinite, "skip");
  EXPECT_EQ(cfg.numerics.max_consecutive_skips, 3);
  EXPECT_EQ(cfg.numerics.loss_spike_factor, 2.5);
  EXPECT_EQ(cfg.numerics.loss_spike_window, 7);
  EXPECT_EQ(cfg.numerics.loss_spike_min_rise, 0.5);
  const auto defaults = d9d::TrainerConfig::from_json_text(base_config(kRun, kBatch, ""));
  EXPECT_EQ(defaults.numerics.on_nonfinite, "stop");
  const auto bad = [](const std::string& numerics) {
    return d9d::testing::error_of<d9d::ConfigError>([&] {
      (void)d9d::TrainerConfig::from_json_text(
          base_config(kRun, kBatch, R"(, "numerics": )" + numerics));
    });
  };
  EXPECT_THAT(bad(R"({"on_nonfinite": "ignore"})"),
              HasSubstr("\"numerics.on_nonfinite\" = \"ignore\" is invalid: expected one of "
                        "\"stop\", \"skip\""));
  EXPECT_THAT(bad(R"({"loss_spike_factor": 1.0})"),
              HasSubstr("\"numerics.loss_spike_factor\" = 1.0 is invalid"));
  EXPECT_THAT(bad(R"({"loss_spike_min_rise": -0.1})"),
              HasSubstr("\"numerics.loss_spike_min_rise\" = -0.1 is invalid"));
  EXPECT_THAT(bad(R"({"max_consecutive_skips": 0})"),
              HasSubstr("\"numerics.max_consecutive_skips\" = 0 is invalid"));
  EXPECT_THAT(bad(R"({"on_nan": "skip"})"), HasSubstr("unknown key \"numerics.on_nan\""));
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// A strategy's contributions to the data and the loss (d9d/parallel/strategy.hpp)

namespace train_test {

// A policy of the context_parallel slot whose strategy keeps the first half of every sequence of
// each microbatch (the tokens [B, T + 1] become [B, T / 2 + 1]) and sums the loss over "cp" too.
struct FirstHalfOfSequence {
  using d9d_slot = d9d::slot::context_parallel;
};

// The same samples cut to their first half by the dataset: what the strategy's sharding must give.
struct FirstHalfWindowsProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  struct Windows {
    d9d::testing::RandomWindows whole;
    [[nodiscard]] int64_t size() const { return whole.size(); }
    [[nodiscard]] d9d::CausalLmBatch get(const std::vector<int64_t>& indices) const {
      auto batch = whole.get(indices);
      batch.tokens = batch.tokens.narrow(1, 0, batch.tokens.size(1) / 2 + 1);
      return batch;
    }
  };
  Windows build(const d9d::DataBuildContext& context) const {
    return {d9d::testing::RandomWindowsProvider{}.build(context)};
  }
};

}  // namespace train_test

template <>
struct d9d::parallel::strategy<train_test::FirstHalfOfSequence> {
  using strategy_concept = d9d::parallel::strategy_tag;
  template <class Plan>
  static constexpr void check() {}
  static void check_mesh(const d9d::MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(d9d::parallel::ParallelModel& /*model*/) {}
  template <class Plan>
  static void contribute(d9d::parallel::StepContributions& contributions) {
    contributions.loss_dims.emplace_back("cp");
    contributions.microbatch.emplace_back([](const std::string& path, const at::Tensor& t) {
      EXPECT_EQ(path, "tokens");
      return t.narrow(1, 0, t.size(1) / 2 + 1);
    });
  }
};

namespace {

TEST(Train_StrategyContributions, InStrategyOrderAfterTheOtherSlots) {
  using Plan = d9d::Plan<train_test::FirstHalfOfSequence>;
  static_assert(
      d9d::parallel::parallel_strategy<d9d::parallel::strategy<train_test::FirstHalfOfSequence>,
                                       Plan>);
  static_assert(
      d9d::parallel::strategy_contributes<d9d::parallel::strategy<train_test::FirstHalfOfSequence>,
                                          Plan>);
  const auto c = d9d::parallel::step_contributions<Plan>();
  // context_parallel comes before data_parallel (Replicate: samples split and losses summed on dp).
  EXPECT_EQ(c.loss_dims, (std::vector<std::string>{"cp", "dp"}));
  EXPECT_EQ(c.sample_dims, (std::vector<std::string>{"dp"}));
  ASSERT_EQ(c.microbatch.size(), 1U);
  const auto plain = d9d::parallel::step_contributions<d9d::Plan<>>();
  EXPECT_EQ(plain.loss_dims, (std::vector<std::string>{"dp"}));
  EXPECT_TRUE(plain.microbatch.empty());
}

TEST(Train_StrategyContributions, TheModelSeesTheShardedMicrobatches) {
  // The strategy's sharding runs on every microbatch before the task's compute_loss: the run equals
  // one whose dataset gives the same samples already cut (float64; same sums in the same order).
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp");  // NOLINT
  using Base = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>, d9d::precision::Fp64>;
  using Sharded = d9d::plan_with_t<Base, train_test::FirstHalfOfSequence>;
  d9d::Trainer<Sharded> sharded(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                d9d::CausalLmTask{},
                                d9d::testing::tiny_run(dir + "/sharded", 3, 8, 4));
  d9d::Trainer<Base> cut(ctx, d9d::Qwen3Provider{}, train_test::FirstHalfWindowsProvider{},
                         d9d::CausalLmTask{}, d9d::testing::tiny_run(dir + "/cut", 3, 8, 4));
  const auto a = sharded.train();
  const auto b = cut.train();
  ASSERT_EQ(a.losses.size(), 3U);
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], d9d::testing::kLossRtol * std::abs(b.losses[i])) << i;
  }
  const auto pa = parameters_of(sharded.core());
  const auto pb = parameters_of(cut.core());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::allclose(pa[i], pb[i], 0.0, d9d::testing::kParameterAtol)) << i;
  }
}

}  // namespace

namespace {

// Trainer's constructor is constrained (d9d::trainer_inputs): std::is_constructible tells whether
// the inputs fit, and each build-failure test of tests/train/build_failure shows the part's
// message.
struct UntaggedProvider {
  d9d::model::Qwen3ForCausalLM build(const d9d::ModelBuildContext& context);
};
struct WholeModelOnlyTask {
  using train_task_concept = d9d::train_task_tag;
  d9d::LossOutput compute_loss(d9d::model::Qwen3ForCausalLM& model, const d9d::CausalLmBatch& b);
};
template <class Plan, class Models, class Task>
constexpr bool constructible =
    std::is_constructible_v<d9d::Trainer<Plan>, d9d::DistributedContext, Models,
                            d9d::TokenFilesProvider, Task, d9d::TrainerConfig>;
using Pipelined = d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>>, d9d::pipeline::OneFOneB<>>;
static_assert(constructible<d9d::Plan<>, d9d::Qwen3Provider, d9d::CausalLmTask>);
static_assert(constructible<Pipelined, d9d::Qwen3Provider, d9d::CausalLmTask>);
static_assert(!constructible<d9d::Plan<>, UntaggedProvider, d9d::CausalLmTask>);
static_assert(constructible<d9d::Plan<>, d9d::Qwen3Provider, WholeModelOnlyTask>);
static_assert(!constructible<Pipelined, d9d::Qwen3Provider, WholeModelOnlyTask>);
static_assert(!d9d::trainer_inputs<Pipelined, d9d::Qwen3Provider, d9d::TokenFilesProvider,
                                   WholeModelOnlyTask>);

}  // namespace
