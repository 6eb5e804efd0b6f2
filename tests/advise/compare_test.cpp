// d9d::bench::compare (d9d/advise/compare.hpp): three Plans of the tiny Qwen3 (Replicate,
// FullyShard, 1F1B pp 2) on 2 Gloo ranks in one call — every row's fields (throughput and its
// ratio, MFU from the given FLOPs, the host's peak above the state, the state held equal to the
// advisor's prediction), the same first loss under every Plan, the table the main rank prints and
// the JSON it writes; `only` and `configure` (one Plan run, with its own config); and the errors
// of bad names, warm-ups, `only` and `configure`.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/advise/compare.hpp>
#include <d9d/d9d.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/support/error_of.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::testing::RankEnv;
using ::testing::HasSubstr;

using Replicated = d9d::Plan<d9d::mesh<d9d::dp_replicate<d9d::dynamic>>>;
using Sharded = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::FullyShard<>>;
using Piped = d9d::Plan<d9d::mesh<d9d::pp<2>>, d9d::pipeline::OneFOneB<>>;

TEST(Bench_Compare_ws2, ThreePlansSideBySideWithTheirPredictions) {
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto config = d9d::testing::tiny_run(env.scratch_dir() + "/cmp", 4, 4, 2, false, 4);
    const std::string json_path = env.scratch_dir() + "/cmp/table.json";
    constexpr double kFlopsPerToken = 1e6;
    ::testing::internal::CaptureStdout();
    const auto comparison = d9d::bench::compare<Replicated, Sharded, Piped>(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
        config,
        {.names = {"replicate", "fsdp", "1f1b"},
         .warmup_steps = 1,
         .flops_per_token = kFlopsPerToken,
         .peak_tflops = 1.0,
         .json_path = json_path});
    const auto printed = ::testing::internal::GetCapturedStdout();

    ASSERT_EQ(comparison.rows.size(), 3U);
    const std::vector<std::string> names{"replicate", "fsdp", "1f1b"};
    const double first = comparison.rows[0].tokens_per_second;
    for (std::size_t i = 0; i < 3; ++i) {
      const auto& row = comparison.rows[i];
      EXPECT_EQ(row.name, names[i]);
      EXPECT_EQ(row.timed_steps, 3) << row.name;
      EXPECT_GT(row.tokens_per_second, 0) << row.name;
      EXPECT_DOUBLE_EQ(row.ratio, row.tokens_per_second / first) << row.name;
      ASSERT_TRUE(row.mfu.has_value()) << row.name;
      EXPECT_DOUBLE_EQ(*row.mfu, row.tokens_per_second * kFlopsPerToken / (2 * 1e12)) << row.name;
      // On the CPU the host bytes of the run: the state, the step's activations and more.
      EXPECT_GT(row.peak_memory_bytes, row.state_bytes) << row.name;
      EXPECT_GT(row.state_bytes, 0) << row.name;
      ASSERT_TRUE(row.predicted_state_bytes.has_value()) << row.name << ": " << row.not_predicted;
      EXPECT_EQ(*row.predicted_state_bytes, row.state_bytes) << row.name;
      EXPECT_TRUE(row.not_predicted.empty()) << row.name;
      // The same model, data and first batch under every Plan.
      EXPECT_NEAR(row.first_loss, comparison.rows[0].first_loss,
                  1e-5 * std::abs(comparison.rows[0].first_loss))
          << row.name;
      EXPECT_NE(row.last_loss, row.first_loss) << row.name << " trained";
    }
    // The advisor's peak (state + activations of the fullest rank) under the host's measured
    // peak, which also holds the step's transient buffers; no tokens/s without a profile.
    for (const auto& row : comparison.rows) {
      ASSERT_TRUE(row.predicted_peak_bytes.has_value()) << row.name;
      EXPECT_GT(*row.predicted_peak_bytes, *row.predicted_state_bytes) << row.name;
      EXPECT_LT(*row.predicted_peak_bytes, row.peak_memory_bytes) << row.name;
      EXPECT_FALSE(row.predicted_tokens_per_second.has_value()) << row.name;
    }
    EXPECT_DOUBLE_EQ(comparison.rows[0].ratio, 1.0);
    // FullyShard halves the state over two ranks; each pipeline rank holds its stage's.
    EXPECT_LT(comparison.rows[1].state_bytes, comparison.rows[0].state_bytes);
    EXPECT_LT(comparison.rows[2].state_bytes, comparison.rows[0].state_bytes);

    const auto table = comparison.table();
    EXPECT_THAT(table, HasSubstr("plan"));
    for (const char* column : {"tokens/s", "tokens/s predicted", "x first", "MFU", "peak memory",
                               "peak predicted", "state held", "state predicted"}) {
      EXPECT_THAT(table, HasSubstr(column));
    }
    for (const auto& name : names) {
      EXPECT_THAT(table, HasSubstr("\n" + name + " ")) << "a row starts with its name";
    }
    if (ctx.is_main_process()) {
      EXPECT_EQ(printed, table);
      std::ifstream in(json_path);
      ASSERT_TRUE(in.good()) << json_path;
      const auto rows = nlohmann::json::parse(in);
      ASSERT_EQ(rows.size(), 3U);
      for (std::size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(rows[i]["name"], names[i]);
        EXPECT_DOUBLE_EQ(rows[i]["tokens_per_second"].get<double>(),
                         comparison.rows[i].tokens_per_second);
        EXPECT_EQ(rows[i]["state_bytes"].get<int64_t>(), comparison.rows[i].state_bytes);
        EXPECT_EQ(rows[i]["predicted_state_bytes"].get<int64_t>(), comparison.rows[i].state_bytes);
        EXPECT_TRUE(rows[i].contains("mfu") && rows[i].contains("peak_memory_bytes") &&
                    rows[i].contains("ratio") && rows[i].contains("last_loss"));
      }
    } else {
      EXPECT_EQ(printed, "") << "only the main rank prints";
    }
  });
}

TEST(Bench_Compare, NamesAndWarmUpAreChecked) {
  auto config = d9d::TrainerConfig{};
  config.run.total_steps = 3;
  using d9d::bench::detail::checked_names;
  EXPECT_EQ(checked_names({}, 2, config), (std::vector<std::string>{"plan-1", "plan-2"}));
  EXPECT_THAT(d9d::testing::error_of([&] { (void)checked_names({.names = {"a"}}, 2, config); }),
              HasSubstr("1 names for 2 Plans"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)checked_names({.names = {"a", "a"}}, 2, config);
              }),
              HasSubstr("'a' is given twice"));
  EXPECT_THAT(d9d::testing::error_of([&] { (void)checked_names({.names = {"a/b"}}, 1, config); }),
              HasSubstr("letters, digits"));
  EXPECT_THAT(d9d::testing::error_of([&] { (void)checked_names({.warmup_steps = 3}, 1, config); }),
              HasSubstr("warmup_steps 3 leaves no timed step of run.total_steps 3"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)checked_names({.names = {"a", "b"}, .only = {"b", "c"}}, 2, config);
              }),
              HasSubstr("'only' names 'c', which is not one of the Plans' names"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)checked_names({.configure = {{}, {}, {}}}, 2, config);
              }),
              HasSubstr("3 configure functions for 2 Plans"));
  using d9d::bench::detail::selected;
  EXPECT_TRUE(selected({}, "a"));
  EXPECT_TRUE(selected({.only = {"b", "a"}}, "a"));
  EXPECT_FALSE(selected({.only = {"b"}}, "a"));
}

// `only` runs the named Plan alone (the other's configure is never called); its configure changes
// the config it trains (three steps instead of four: two timed), under its own output directory,
// trace folder and checkpoint folder.
TEST(Bench_Compare, OnlyTheNamedPlansRunEachWithItsConfigure) {
  const auto dir = ::testing::TempDir() + "d9d_compare_only";
  const auto config = d9d::testing::tiny_run(dir, 4, 2, 2, false, 2);
  const auto ctx = d9d::DistributedContext::local();
  std::string trained_under;
  std::string traced_under;
  std::string checkpointed_under;
  const auto comparison = d9d::bench::compare<Replicated, Sharded>(
      ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{}, config,
      {.names = {"first", "second"},
       .print = false,
       .configure = {[](d9d::TrainerConfig&) { throw std::logic_error("'first' is not run"); },
                     [&](d9d::TrainerConfig& c) {
                       trained_under = c.run.output_dir;
                       traced_under = c.profile.dir;
                       checkpointed_under = c.checkpoint.dir;
                       c.run.total_steps = 3;
                     }},
       .only = {"second"}});
  ASSERT_EQ(comparison.rows.size(), 1U);
  const auto& row = comparison.rows[0];
  EXPECT_EQ(row.name, "second");
  EXPECT_EQ(row.timed_steps, 2);
  EXPECT_DOUBLE_EQ(row.ratio, 1.0) << "the ratio is to the first row run";
  EXPECT_GT(row.host_issue_ms, 0.0);
  EXPECT_EQ(trained_under, dir + "/second");
  // The trace and checkpoint folders the config derived from its output_dir follow the Plan's.
  EXPECT_EQ(config.profile.dir, dir + "/profile");
  EXPECT_EQ(traced_under, dir + "/second/profile");
  EXPECT_EQ(checkpointed_under, dir + "/second/checkpoints");
  EXPECT_TRUE(nlohmann::json::parse(comparison.json())[0].contains("host_issue_ms"));
}

// On the CPU compare measures the host memory through the profiler's hook, so a Plan that traces
// steps is refused before it trains, naming the fix (on a GPU no meter is installed and tracing
// works).
TEST(Bench_Compare, ATracedPlanOnTheCpuIsRefusedBeforeItTrains) {
  const auto dir = ::testing::TempDir() + "d9d_compare_traced";
  const auto config = d9d::testing::tiny_run(dir, 2, 2, 2, false, 2);
  const auto ctx = d9d::DistributedContext::local();
  EXPECT_THAT(
      d9d::testing::error_of([&] {
        (void)d9d::bench::compare<Replicated>(
            ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
            config,
            {.print = false, .configure = {[](d9d::TrainerConfig& c) { c.profile.start = 1; }}});
      }),
      HasSubstr("Plan 'plan-1' traces steps (profile.start 1) on the CPU"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/plan-1/profile"));
}

// A row without a prediction shows "-" and says why under the table; MFU "-" without FLOPs.
TEST(Bench_Compare, ARowWithoutAPredictionSaysWhy) {
  d9d::bench::Comparison comparison;
  comparison.rows.push_back(
      {.name = "lora",
       .timed_steps = 2,
       .tokens_per_second = 1234.4,
       .ratio = 1.0,
       .state_bytes = int64_t{3} * 1024 * 1024,
       .not_predicted = "a PEFT policy other than FullTune is not predicted"});
  const auto table = comparison.table();
  EXPECT_THAT(table, HasSubstr("lora  1,234"));
  EXPECT_THAT(table, HasSubstr("lora: not predicted: a PEFT policy other than FullTune"));
  std::istringstream lines(table);
  std::string header;
  std::string row;
  std::getline(lines, header);
  std::getline(lines, row);
  EXPECT_EQ(row.back(), '-') << row;
  const auto rows = nlohmann::json::parse(comparison.json());
  EXPECT_TRUE(rows[0]["predicted_state_bytes"].is_null());
  EXPECT_TRUE(rows[0]["mfu"].is_null());
}

}  // namespace
