// Generation with Qwen3 (d9d::model::generate, include/d9d/model/qwen3.hpp) and the token
// placements under it (include/d9d/model/layers.hpp): greedy continuations equal transformers'
// (tests/hf/make_generation_fixture.py, committed), the KV cache gives what recomputing the whole
// sequence gives, a left-padded batch continues each row as it would alone, sampling follows the
// distribution it claims, and packed documents compute what separate forwards do (also through
// d9d::CausalLmTask's document_separator, include/d9d/train/causal_lm.hpp).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/causal_lm.hpp>
#include <d9d/util/files.hpp>

#include "tests/hf/hf_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using ::testing::HasSubstr;
using Tokens = std::vector<std::vector<int64_t>>;

using hf_test::fixture;
using hf_test::named;

Tokens rows_of(const at::Tensor& table) {
  Tokens rows;
  const auto cpu = table.contiguous();
  for (int64_t r = 0; r < cpu.size(0); ++r) {
    std::vector<int64_t> row;
    for (int64_t c = 0; c < cpu.size(1); ++c) {
      const int64_t id = cpu[r][c].item<int64_t>();
      if (id >= 0) {  // -1 pads the fixture's prompts
        row.push_back(id);
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// A small random float64 model: 3 layers, GQA, vocabulary large enough for sampling statistics.
d9d::model::Qwen3ForCausalLM small_model(bool tied = false) {
  const d9d::model::Qwen3Config config{
      .vocab_size = 64,
      .hidden_size = 32,
      .intermediate_size = 40,
      .num_hidden_layers = 3,
      .num_attention_heads = 4,
      .num_key_value_heads = 2,
      .head_dim = 8,
      .rope_theta = 1e4,
      .tie_word_embeddings = tied,
      .initializer_range = 0.5,  // sharp logits: greedy choices with clear margins
  };
  torch::manual_seed(2026);
  d9d::model::Qwen3ForCausalLM model(config);
  model->to(at::kDouble);
  return model;
}

const Tokens kPrompts = {{3, 9, 27, 50, 17, 5}, {60}, {1, 2, 3, 4}};

// ------------------------------------------------------------------------------------------------
// Against transformers

class Generate_Transformers : public ::testing::TestWithParam<std::string> {};

TEST_P(Generate_Transformers, GreedyEqualsTheirsInABatchAndAlone) {
  const auto dir = fixture(GetParam());
  const auto reference = d9d::state::load_safetensors(dir + "/generation.safetensors");
  const auto prompts = rows_of(named(reference, "prompts"));
  const auto expected = rows_of(named(reference, "greedy"));
  ASSERT_EQ(prompts.size(), 3U);
  // transformers' logits differ from ours by rounding only (float32 rotary tables there, float64
  // here: ~1e-8); every greedy step of the fixture has a margin above 1e-6 (checked where made).
  EXPECT_GT(named(reference, "margin").min().item<double>(), 1e-6);
  auto model = d9d::model::load_hf_qwen3(dir);
  model->to(at::kDouble);
  const d9d::model::GenerationOptions options{.max_new_tokens = 16};
  EXPECT_EQ(d9d::model::generate(*model, prompts, options), expected);
  for (std::size_t row = 0; row < prompts.size(); ++row) {
    EXPECT_EQ(d9d::model::generate(*model, {prompts[row]}, options), Tokens{expected[row]})
        << "prompt " << row << " alone";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Generate_Transformers,
                         ::testing::Values("qwen3_tiny_untied", "qwen3_tiny_tied"));

// ------------------------------------------------------------------------------------------------
// The KV cache and the placements

TEST(Generate_Cache, GreedyAndSampledTokensEqualRecomputingTheSequence) {
  for (const bool tied : {false, true}) {
    auto model = small_model(tied);
    d9d::model::GenerationOptions options{.max_new_tokens = 12};
    const auto cached = d9d::model::generate(*model, kPrompts, options);
    options.use_cache = false;
    EXPECT_EQ(d9d::model::generate(*model, kPrompts, options), cached) << "tied " << tied;
    for (std::size_t row = 0; row < kPrompts.size(); ++row) {
      EXPECT_EQ(d9d::model::generate(*model, {kPrompts[row]}, options), Tokens{cached[row]})
          << "prompt " << row << " alone, tied " << tied;
    }
    options = {.max_new_tokens = 12, .temperature = 0.9, .top_p = 0.8, .seed = 7};
    const auto sampled = d9d::model::generate(*model, kPrompts, options);
    options.use_cache = false;
    EXPECT_EQ(d9d::model::generate(*model, kPrompts, options), sampled) << "tied " << tied;
  }
}

// The logits of each cached decoding step equal the last logits of the whole sequence so far.
TEST(Generate_Cache, StepLogitsEqualTheWholeSequencesLogits) {
  auto model = small_model();
  const at::NoGradGuard no_grad;
  const auto& rope = model->model->rope();
  const auto sequence = at::tensor({4, 8, 15, 16, 23, 42, 7, 11}, at::kLong).unsqueeze(0);
  const auto whole = model->forward(sequence);  // [1, 8, vocab]
  const int64_t prompt = 3;
  const int64_t total = sequence.size(1);
  auto cache = model->make_cache(1, total, at::TensorOptions().dtype(at::kDouble));
  const auto valid = at::ones({1, total}, at::kBool);
  auto logits = model->forward_placed(
      sequence.narrow(1, 0, prompt),
      d9d::model::place_tokens(rope, at::arange(prompt, at::kLong).unsqueeze(0),
                               valid.narrow(1, 0, prompt), 0, at::kDouble),
      &cache);
  cache.length = prompt;
  EXPECT_TRUE(at::allclose(logits, whole.narrow(1, 0, prompt), 1e-12, 1e-12));
  for (int64_t t = prompt; t < total; ++t) {
    logits =
        model->forward_placed(sequence.narrow(1, t, 1),
                              d9d::model::place_tokens(rope, at::full({1, 1}, t, at::kLong),
                                                       valid.narrow(1, 0, t + 1), t, at::kDouble),
                              &cache);
    cache.length = t + 1;
    EXPECT_TRUE(at::allclose(logits.squeeze(1), whole.select(1, t), 1e-12, 1e-12)) << "step " << t;
  }
}

TEST(Generate_Placement, PackedDocumentsComputeWhatSeparateForwardsDo) {
  auto model = small_model();
  const auto& rope = model->model->rope();
  const std::vector<std::vector<int64_t>> documents = {{5, 6, 7}, {40, 41, 42, 43}, {9}};
  std::vector<int64_t> packed;
  std::vector<int64_t> ids;
  for (std::size_t d = 0; d < documents.size(); ++d) {
    packed.insert(packed.end(), documents[d].begin(), documents[d].end());
    ids.insert(ids.end(), documents[d].size(), static_cast<int64_t>(d));
  }
  const auto input = at::tensor(packed, at::kLong).unsqueeze(0);
  const auto placement =
      d9d::model::place_documents(rope, at::tensor(ids, at::kLong).unsqueeze(0), at::kDouble);
  const auto together = model->forward_placed(input, placement, nullptr);
  // Gradients flow through the placed path as through the plain one.
  together.pow(2).sum().backward();
  std::map<std::string, at::Tensor> packed_grads;
  for (const auto& item : model->named_parameters()) {
    packed_grads[item.key()] = item.value().grad().clone();
    item.value().mutable_grad().zero_();
  }
  int64_t offset = 0;
  for (const auto& document : documents) {
    const auto size = static_cast<int64_t>(document.size());
    const auto alone = model->forward(at::tensor(document, at::kLong).unsqueeze(0));
    EXPECT_TRUE(at::allclose(together.narrow(1, offset, size), alone, 1e-12, 1e-12))
        << "document at " << offset;
    alone.pow(2).sum().backward();
    offset += size;
  }
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::allclose(packed_grads[item.key()], item.value().grad(), 1e-10, 1e-12))
        << item.key();
  }
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                (void)d9d::model::place_documents(
                    rope, at::tensor({0, 0, 1, 0}, at::kLong).unsqueeze(0), at::kDouble);
              }),
              HasSubstr("contiguous"));
}

// Two windows of packed documents (separator 63): the task's loss is the sum of each document's
// own next-token losses, and its weight counts their targets; gradients match too.
TEST(Generate_Placement, CausalLmTaskKeepsPackedDocumentsApart) {
  auto model = small_model();
  const int64_t sep = 63;
  const std::vector<int64_t> tokens{5, 6, 7, sep, 40, 41, 42, 43, 9, sep, 1, 2, 3, 4, 5, 6, 7, 8};
  const auto windows = at::tensor(tokens, at::kLong).view({2, 9});
  d9d::CausalLmTask task(d9d::CausalLmOptions{.document_separator = sep});
  const auto packed = task.compute_loss(model, d9d::CausalLmBatch{windows});
  packed.loss_sum.backward();
  std::map<std::string, at::Tensor> packed_grads;
  for (const auto& item : model->named_parameters()) {
    packed_grads[item.key()] = item.value().grad().clone();
    item.value().mutable_grad().zero_();
  }
  // The documents alone: [5 6 7 sep] [40 41 42 43 9] | [sep 1] [2 ... 8]: a window's tokens after
  // its last separator are the start of a document; a document's loss covers its own targets.
  const std::vector<std::vector<int64_t>> documents = {
      {5, 6, 7, sep}, {40, 41, 42, 43, 9}, {sep}, {1, 2, 3, 4, 5, 6, 7, 8}};
  at::Tensor loss_sum = at::zeros({}, at::kDouble);
  int64_t targets = 0;
  for (const auto& document : documents) {
    if (document.size() < 2) {
      continue;
    }
    const auto ids = at::tensor(document, at::kLong).unsqueeze(0);
    const auto size = ids.size(1);
    const auto loss = model->loss(ids.narrow(1, 0, size - 1), ids.narrow(1, 1, size - 1));
    loss_sum = loss_sum + loss.loss_sum;
    targets += loss.tokens.item<int64_t>();
  }
  loss_sum.backward();
  EXPECT_EQ(packed.weight.item<int64_t>(), targets);
  EXPECT_NEAR(packed.loss_sum.item<double>(), loss_sum.item<double>(), 1e-10);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::allclose(packed_grads[item.key()], item.value().grad(), 1e-10, 1e-12))
        << item.key();
  }
  // Without the separator the windows are single sequences: another loss.
  const auto plain = d9d::CausalLmTask{}.compute_loss(model, d9d::CausalLmBatch{windows});
  EXPECT_GT(plain.weight.item<int64_t>(), targets);
}

TEST(Generate_Placement, PlainPlacementEqualsTheCausalForward) {
  auto model = small_model();
  const at::NoGradGuard no_grad;
  const auto input = at::tensor({1, 2, 3, 4, 5, 6, 7, 8}, at::kLong).view({2, 4});
  const auto where = d9d::model::place_tokens(model->model->rope(),
                                              at::arange(4, at::kLong).expand({2, 4}).contiguous(),
                                              at::ones({2, 4}, at::kBool), 0, at::kDouble);
  EXPECT_TRUE(at::allclose(model->forward_placed(input, where, nullptr), model->forward(input),
                           1e-12, 1e-12));
}

// ------------------------------------------------------------------------------------------------
// Sampling

// The first sampled token of 4000 copies of one prompt follows softmax(logits / T) restricted to
// the nucleus: every frequency within 5 standard deviations of its probability, no token outside.
TEST(Generate_Sampling, FirstTokensFollowTheNucleusDistribution) {
  auto model = small_model();
  const std::vector<int64_t> prompt{3, 1, 4, 1, 5};
  const double temperature = 1.5;
  const double top_p = 0.7;
  at::Tensor probs;
  {
    const at::NoGradGuard no_grad;
    const auto logits = model->forward(at::tensor(prompt, at::kLong).unsqueeze(0));
    probs = at::softmax(logits[0][-1] / temperature, -1);
  }
  // The nucleus: the most likely tokens until their sum reaches top_p.
  const auto [sorted, order] = probs.sort(-1, true);
  const auto before = sorted.cumsum(-1) - sorted;
  auto nucleus = at::zeros_like(probs).scatter(-1, order, sorted.masked_fill(before.ge(top_p), 0));
  nucleus = nucleus / nucleus.sum();
  ASSERT_GT((nucleus > 0).sum().item<int64_t>(), 2) << "a nucleus of several tokens";
  ASSERT_LT((nucleus > 0).sum().item<int64_t>(), probs.size(0)) << "some tokens cut";

  const int64_t draws = 4000;
  const auto tokens = d9d::model::generate(
      *model, Tokens(draws, prompt),
      {.max_new_tokens = 1, .temperature = temperature, .top_p = top_p, .seed = 11});
  std::vector<int64_t> counts(static_cast<std::size_t>(probs.size(0)), 0);
  for (const auto& row : tokens) {
    ASSERT_EQ(row.size(), 1U);
    ++counts[static_cast<std::size_t>(row[0])];
  }
  for (int64_t id = 0; id < probs.size(0); ++id) {
    const double p = nucleus[id].item<double>();
    const double frequency =
        static_cast<double>(counts[static_cast<std::size_t>(id)]) / static_cast<double>(draws);
    if (p == 0) {
      EXPECT_EQ(counts[static_cast<std::size_t>(id)], 0) << "token " << id << " is outside";
    } else {
      EXPECT_NEAR(frequency, p, 5 * std::sqrt(p * (1 - p) / static_cast<double>(draws)))
          << "token " << id;
    }
  }
  // The same seed gives the same tokens; a tiny nucleus is greedy.
  EXPECT_EQ(d9d::model::generate(
                *model, Tokens(draws, prompt),
                {.max_new_tokens = 1, .temperature = temperature, .top_p = top_p, .seed = 11}),
            tokens);
  EXPECT_EQ(d9d::model::generate(*model, {prompt},
                                 {.max_new_tokens = 6, .temperature = 2.0, .top_p = 1e-9}),
            d9d::model::generate(*model, {prompt}, {.max_new_tokens = 6}));
}

TEST(Generate_Sampling, StopTokensEndARowAndBadInputIsNamed) {
  auto model = small_model();
  const auto free_run = d9d::model::generate(*model, kPrompts, {.max_new_tokens = 10});
  const int64_t stop = free_run[0][2];
  const auto stopped =
      d9d::model::generate(*model, kPrompts, {.max_new_tokens = 10, .stop_tokens = {stop}});
  for (std::size_t row = 0; row < kPrompts.size(); ++row) {
    // Each row is the free run up to and including the first stop token.
    std::vector<int64_t> expected;
    for (const int64_t id : free_run[row]) {
      expected.push_back(id);
      if (id == stop) {
        break;
      }
    }
    EXPECT_EQ(stopped[row], expected) << "row " << row;
  }
  const auto error = [&](const Tokens& prompts, const d9d::model::GenerationOptions& options) {
    return d9d::testing::error_of<std::invalid_argument>(
        [&] { (void)d9d::model::generate(*model, prompts, options); });
  };
  EXPECT_THAT(error({{1}, {}}, {}), HasSubstr("prompt 1 is empty"));
  EXPECT_THAT(error({{1, 64}}, {}), HasSubstr("token 64 at position 1"));
  EXPECT_THAT(error({{1}}, {.top_p = 0}), HasSubstr("top_p must be in (0, 1]"));
  EXPECT_THAT(error({{1}}, {.temperature = -1}), HasSubstr("temperature"));
  EXPECT_THAT(error({{1}}, {.stop_tokens = {99}}), HasSubstr("stop token 99"));
  EXPECT_TRUE(model->is_training()) << "generate restores the training flag";
}

}  // namespace
