// d9d::advise::enumerate_candidates (d9d/advise/candidates.hpp): for worlds of 1 to 8 ranks, the
// candidates are exactly the Plan shapes a brute force over every degree, data parallelism and
// schedule keeps under the library's rules (the mesh, the batch split, context parallelism's
// chunks and the schedules' programs, each through the library's own check; tensor parallelism's
// divisibility), each once, in order; and named cases each rule excludes.
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/advise/candidates.hpp>
#include <d9d/d9d.hpp>

#include "tests/support/error_of.hpp"

namespace {

using d9d::advise::Candidate;

// A tiny Qwen3 (4 heads over 2 KV heads, 4 layers) and its batch.
d9d::TrainerConfig config_of(int64_t global, int64_t microbatch, int64_t sequence) {
  return d9d::TrainerConfig::from_json_text(
      R"({"run": {"output_dir": "unused", "total_steps": 1},
          "batch": {"global_batch_size": )" +
      std::to_string(global) + R"(, "microbatch_size": )" + std::to_string(microbatch) +
      R"(, "sequence_length": )" + std::to_string(sequence) + R"(},
          "model": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "tie_word_embeddings": false}})");
}

template <class F>
bool holds(F&& rule) {
  try {
    rule();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Every shape, kept by the rules one at a time.
std::vector<Candidate> brute_force(const d9d::TrainerConfig& config, int world) {
  std::vector<Candidate> out;
  const auto sequence = config.batch.sequence_length;
  for (const bool fully_shard : {false, true}) {
    for (int pp = 1; pp <= world; ++pp) {
      for (int tp = 1; tp <= world; ++tp) {
        for (int cp = 1; cp <= world; ++cp) {
          for (int dp_replicate = 1; dp_replicate <= world; ++dp_replicate) {
            for (int dp_shard = 1; dp_shard <= world; ++dp_shard) {
              d9d::MeshShape shape;
              shape.pp = pp;
              shape.tp = tp;
              shape.cp_shard = cp;
              shape.dp_replicate = dp_replicate;
              shape.dp_shard = dp_shard;
              if (!shape.validate(world).empty() || (!fully_shard && dp_shard > 1)) {
                continue;
              }
              // tp splits 4 heads, 2 KV heads, 64 intermediate, 64 vocabulary rows.
              if (2 % tp != 0) {
                continue;
              }
              if (cp > 1 && !holds([&] { d9d::model::check_context_length(sequence, cp); })) {
                continue;
              }
              if (cp > 1 && tp > 1 && (sequence / cp) % tp != 0) {
                continue;
              }
              const int dp = dp_replicate * dp_shard;
              if (!holds([&] { config.check_against_data_parallel(dp); })) {
                continue;
              }
              const auto m = static_cast<int>(config.microbatches_per_step(dp));
              Candidate c{.fully_shard = fully_shard,
                          .dp_replicate = dp_replicate,
                          .dp_shard = dp_shard,
                          .cp = cp,
                          .tp = tp,
                          .pp = pp,
                          .schedule = {},
                          .microbatches = m};
              if (pp == 1) {
                out.push_back(c);
                continue;
              }
              for (const auto& name : d9d::advise::schedule_names()) {
                d9d::pipeline::Program program;
                if (!holds([&] { program = d9d::advise::build_schedule(name, pp, m); }) ||
                    program.stages() > 4) {
                  continue;
                }
                c.schedule = name;
                out.push_back(c);
              }
            }
          }
        }
      }
    }
  }
  return out;
}

std::set<std::string> names_of(const std::vector<Candidate>& candidates) {
  std::set<std::string> out;
  for (const auto& c : candidates) {
    out.insert(c.describe());
  }
  return out;
}

TEST(Advise_Candidates, AreWhatTheRulesKeepForWorldsOneToEight) {
  for (const auto& [global, microbatch, sequence] :
       {std::tuple<int64_t, int64_t, int64_t>{8, 1, 16}, {16, 2, 12}, {6, 1, 32}}) {
    const auto config = config_of(global, microbatch, sequence);
    for (int world = 1; world <= 8; ++world) {
      const auto enumerated = d9d::advise::enumerate_candidates(config, world);
      const auto expected = brute_force(config, world);
      const auto what = "world " + std::to_string(world) + ", batch " + std::to_string(global) +
                        " / " + std::to_string(microbatch) + " x " + std::to_string(sequence);
      EXPECT_EQ(names_of(enumerated), names_of(expected)) << what;
      EXPECT_EQ(names_of(enumerated).size(), enumerated.size()) << what << ": each once";
      EXPECT_EQ(enumerated.size(), expected.size()) << what;
      for (std::size_t i = 1; i < enumerated.size(); ++i) {
        EXPECT_LE(enumerated[i - 1].fully_shard, enumerated[i].fully_shard) << what;
      }
    }
  }
}

TEST(Advise_Candidates, EachRuleExcludesItsCases) {
  const auto config = config_of(8, 1, 12);
  const auto all = names_of(d9d::advise::enumerate_candidates(config, 8));
  const auto has = [&](const std::string& name) { return all.count(name) == 1; };
  EXPECT_TRUE(has("replicate dp 8, 1 microbatch"));
  EXPECT_TRUE(has("fully_shard dp_shard 8, 1 microbatch"));
  EXPECT_TRUE(has("fully_shard dp_replicate 2 x dp_shard 4, 1 microbatch")) << "HSDP";
  EXPECT_TRUE(has("replicate dp 4 x tp 2, 2 microbatches"));
  EXPECT_FALSE(has("replicate dp 2 x tp 4, 4 microbatches")) << "4 does not divide 2 KV heads";
  EXPECT_TRUE(has("replicate dp 4 x cp 2, 2 microbatches")) << "12 tokens in 4 chunks";
  EXPECT_FALSE(has("replicate dp 2 x cp 4, 4 microbatches")) << "12 tokens in 8 chunks";
  EXPECT_TRUE(has("replicate dp 2 x pp 4 (1f1b), 4 microbatches"));
  EXPECT_FALSE(has("replicate dp 2 x pp 4 (dualpipev), 4 microbatches")) << "needs 8";
  EXPECT_FALSE(has("replicate dp 2 x pp 4 (interleaved), 4 microbatches")) << "8 stages, 4 layers";
  EXPECT_FALSE(has("replicate pp 8 (gpipe), 8 microbatches")) << "8 stages, 4 layers";
  EXPECT_TRUE(has("fully_shard dp_shard 2 x pp 4 (zbh1), 4 microbatches"));
  // Switched off, a kind of parallelism is not enumerated.
  for (const auto& c : d9d::advise::enumerate_candidates(
           config, 8, {.tensor_parallel = false, .context_parallel = false, .pipelines = false})) {
    EXPECT_EQ(c.tp * c.cp * c.pp, 1) << c.describe();
  }
  EXPECT_THAT(d9d::testing::error_of([&] { (void)d9d::advise::enumerate_candidates(config, 0); }),
              ::testing::HasSubstr("a world of 0 ranks"));
  EXPECT_THAT(d9d::testing::error_of([] { (void)d9d::advise::build_schedule("zb", 2, 4); }),
              ::testing::HasSubstr("unknown schedule \"zb\""));
}

}  // namespace
