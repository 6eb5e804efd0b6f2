// Pipeline schedules as programs: every builder verifies (at compile time for a few sizes, at run
// time for the grid), bubble fractions match the known formulas, memory matches 1F1B where the
// schedule promises it, and verify() catches each rule on deliberately broken programs.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/pipeline/schedules.hpp>

#include "tests/support/error_of.hpp"

namespace {

namespace pl = d9d::pipeline;
using pl::Action;
using pl::Op;
using pl::Program;
using pl::Rule;

// ---- compile time: the builders run inside the compiler --------------------------------------
static_assert(pl::verify(pl::with_communication(pl::one_f_one_b(4, 8))).ok());
static_assert(pl::verify(pl::with_communication(pl::interleaved_1f1b(4, 2, 8))).ok());
static_assert(pl::verify(pl::with_communication(pl::zero_bubble_h1(4, 8))).ok());
static_assert(pl::verify(pl::with_communication(pl::zero_bubble_v(4, 8))).ok());
static_assert(pl::verify(pl::with_communication(pl::looped_bfs(2, 3, 4))).ok());
static_assert(pl::verify(pl::with_communication(pl::inference(4, 4))).ok());
static_assert(pl::pipeline_schedule<pl::ZeroBubbleH1<pl::microbatches<8>>>);
static_assert(!pl::pipeline_schedule<pl::NoPipeline>);

constexpr pl::Costs kUnit{.forward = 1, .backward_input = 1, .backward_weight = 1};

Program build(const std::string& name, int pp, int m) {
  if (name == "GPipe") {
    return pl::gpipe(pp, m);
  }
  if (name == "OneFOneB") {
    return pl::one_f_one_b(pp, m);
  }
  if (name == "Interleaved1F1B_v2") {
    return pl::interleaved_1f1b(pp, 2, m);
  }
  if (name == "LoopedBfs_v2") {
    return pl::looped_bfs(pp, 2, m);
  }
  if (name == "ZeroBubbleH1") {
    return pl::zero_bubble_h1(pp, m);
  }
  if (name == "ZeroBubbleV") {
    return pl::zero_bubble_v(pp, m);
  }
  return pl::inference(pp, m);
}

class Pipeline_Schedule : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(Pipeline_Schedule, VerifiesWithAndWithoutCommunication) {
  const auto& [name, pp, m] = GetParam();
  if (name == "Interleaved1F1B_v2" && m % pp != 0) {
    GTEST_SKIP() << "interleaved 1F1B needs m % pp == 0";
  }
  const auto program = build(name, pp, m);
  const auto plain = pl::verify(program);
  EXPECT_TRUE(plain.ok()) << name << " " << pl::to_string(plain.rule) << " rank " << plain.rank
                          << " " << pl::to_string(plain.action);
  const auto full = pl::verify(pl::with_communication(program));
  EXPECT_TRUE(full.ok()) << name << " " << pl::to_string(full.rule) << " rank " << full.rank << " "
                         << pl::to_string(full.action);
  // Every rank keeps a bounded number of activations alive.
  for (const int peak : full.peak_activations) {
    EXPECT_LE(peak, program.stages_per_rank * m);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, Pipeline_Schedule,
    ::testing::Combine(::testing::Values("GPipe", "OneFOneB", "Interleaved1F1B_v2", "LoopedBfs_v2",
                                         "ZeroBubbleH1", "ZeroBubbleV", "Inference"),
                       ::testing::Values(2, 4, 8), ::testing::Values(1, 2, 4, 8, 16)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_pp" + std::to_string(std::get<1>(info.param)) + "_mb" +
             std::to_string(std::get<2>(info.param));
    });

// ---- bubbles for equal F, I, W costs ---------------------------------------------------------

class Pipeline_Bubble : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(Pipeline_Bubble, MatchTheFormulas) {
  const auto [pp, m] = GetParam();
  const double p = pp;
  const double mb = m;
  const auto bubble = [&](const Program& program) {
    return pl::simulate(pl::with_communication(program), kUnit).bubble_fraction();
  };
  const double one_f_one_b = bubble(pl::one_f_one_b(pp, m));
  EXPECT_NEAR(one_f_one_b, (p - 1) / (mb + p - 1), 1e-12);
  EXPECT_NEAR(bubble(pl::gpipe(pp, m)), (p - 1) / (mb + p - 1), 1e-12);
  // Interleaved 1F1B with v stages per rank: the bubble shrinks v-fold, (p - 1) / (v m + p - 1).
  EXPECT_NEAR(bubble(pl::interleaved_1f1b(pp, 2, m)), (p - 1) / (2 * mb + p - 1), 1e-12);
  // ZB-H1: a third of 1F1B's idle time, (p - 1) units of 3 m + p - 1, when m >= p.
  const double h1 = bubble(pl::zero_bubble_h1(pp, m));
  EXPECT_NEAR(h1, (p - 1) / (3 * mb + p - 1), 1e-12);
  EXPECT_LT(h1, 0.5 * one_f_one_b);
  // ZBV: only the start-up wait of the last rank, (p - 1) units of 6 m + p - 1, when m >= 2p.
  const double v = bubble(pl::zero_bubble_v(pp, m));
  if (m >= 2 * pp) {
    EXPECT_NEAR(v, (p - 1) / (6 * mb + p - 1), 1e-12);
  }
  EXPECT_LT(v, h1);
}

INSTANTIATE_TEST_SUITE_P(Sizes, Pipeline_Bubble,
                         ::testing::Values(std::make_tuple(2, 4), std::make_tuple(2, 8),
                                           std::make_tuple(4, 8), std::make_tuple(4, 16),
                                           std::make_tuple(8, 16), std::make_tuple(8, 32)),
                         [](const auto& info) {
                           return "pp" + std::to_string(std::get<0>(info.param)) + "_mb" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Pipeline_Memory, OneFOneBAndZeroBubbleKeepItsActivationBound) {
  for (const int pp : {2, 4, 8}) {
    for (const int m : {4, 8, 16}) {
      const auto a = pl::verify(pl::with_communication(pl::one_f_one_b(pp, m)));
      const auto h = pl::verify(pl::with_communication(pl::zero_bubble_h1(pp, m)));
      const auto v = pl::verify(pl::with_communication(pl::zero_bubble_v(pp, m)));
      for (int r = 0; r < pp; ++r) {
        const auto rr = static_cast<std::size_t>(r);
        EXPECT_EQ(a.peak_activations[rr], std::min(pp - r, m)) << "1F1B rank " << r;
        EXPECT_LE(h.peak_activations[rr], a.peak_activations[rr]) << "ZB-H1 rank " << r;
        // ZBV's stages are half as deep: 2 pp of them weigh what pp full stages do.
        EXPECT_LE(v.peak_activations[rr], 2 * pp) << "ZBV rank " << r;
      }
      // GPipe keeps every microbatch alive on rank 0.
      EXPECT_EQ(pl::verify(pl::with_communication(pl::gpipe(pp, m))).peak_activations[0], m);
    }
  }
}

TEST(Pipeline_Program, ActionsPrintAsStageOpMicrobatch) {
  const auto program = pl::with_communication(pl::one_f_one_b(2, 2));
  std::string rank0;
  for (const auto& a : program.ranks[0]) {
    rank0 += pl::to_string(a) + " ";
  }
  // Warm-up F0, then F1 and B0, then B1; stage 0 sends activations and receives gradients.
  EXPECT_EQ(rank0, "0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0B0 0RG1<1 0B1 ");
  EXPECT_EQ(pl::to_string(Action{.op = Op::backward_weight, .stage = 3, .microbatch = 7}), "3W7");
  EXPECT_EQ(pl::stage_rank(pl::Placement::v, 4, 5), 2);
  EXPECT_EQ(pl::rank_stages(pl::Placement::v, 4, 2, 1), (std::vector<int>{1, 6}));
}

// ---- verify() catches each rule --------------------------------------------------------------

Program two_rank_1f1b() { return pl::with_communication(pl::one_f_one_b(2, 2)); }

TEST(Pipeline_Verify, CatchesEveryRule) {
  {
    auto p = pl::one_f_one_b(2, 2);
    p.ranks[0][0].stage = 1;  // stage 1 lives on rank 1
    EXPECT_EQ(pl::verify(p).rule, Rule::wrong_rank);
  }
  {
    auto p = pl::one_f_one_b(2, 2);
    p.ranks[1].pop_back();
    EXPECT_EQ(pl::verify(p).rule, Rule::missing);
  }
  {
    auto p = pl::one_f_one_b(2, 2);
    p.ranks[0].push_back(p.ranks[0].front());
    EXPECT_EQ(pl::verify(p).rule, Rule::duplicate);
  }
  {
    auto p = pl::one_f_one_b(2, 2);
    p.ranks[0].back().op = Op::backward_input;
    EXPECT_EQ(pl::verify(p).rule, Rule::backward_kind);
  }
  {
    auto p = pl::gpipe(2, 2);
    std::swap(p.ranks[0].front(), p.ranks[0].back());
    const auto verdict = pl::verify(p);
    EXPECT_EQ(verdict.rule, Rule::order);
    EXPECT_EQ(verdict.rank, 0);
    EXPECT_EQ(pl::to_string(verdict.action), "0B1");
  }
  {
    auto p = two_rank_1f1b();
    auto& rank1 = p.ranks[1];
    rank1.erase(rank1.begin());  // drop rank 1's first receive
    EXPECT_EQ(pl::verify(p).rule, Rule::unmatched);
  }
  {
    // Rank 1 runs its backwards before its forwards' inputs can arrive: rank 0 waits for the
    // gradient while rank 1 waits for the activation.
    auto p = pl::gpipe(2, 2);
    auto& rank0 = p.ranks[0];
    std::rotate(rank0.begin(), rank0.begin() + 2, rank0.end());  // B0 B1 F0 F1: order rule first
    EXPECT_EQ(pl::verify(p).rule, Rule::order);
    auto q = pl::with_communication(pl::gpipe(2, 2));
    auto& r0 = q.ranks[0];
    // Move rank 0's first send behind its receives of gradients: a cycle of waits.
    const auto send = std::find_if(r0.begin(), r0.end(),
                                   [](const Action& a) { return a.op == Op::send_activation; });
    const Action moved = *send;
    r0.erase(send);
    r0.push_back(moved);
    const auto verdict = pl::verify(q);
    EXPECT_EQ(verdict.rule, Rule::deadlock);
    EXPECT_EQ(verdict.rank, 0);
  }
}

TEST(Pipeline_BuildProgram, RunTimeSizesAreCheckedLikeStaticOnes) {
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)pl::build_program<pl::OneFOneB<>>(4, 2); }),
              ::testing::HasSubstr("needs microbatches >= the pipeline degree (got 2 < 4)"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([] {
                (void)pl::build_program<pl::Interleaved1F1B<pl::stages_per_rank<2>>>(4, 6);
              }),
              ::testing::HasSubstr("must be a multiple of the pipeline degree"));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [] { (void)pl::build_program<pl::GPipe<pl::microbatches<8>>>(4, 6); }),
              ::testing::HasSubstr("fixes 8 microbatches, the run asks 6"));
  EXPECT_EQ(pl::build_program<pl::ZeroBubbleV<>>(2, 4).ranks.size(), 2U);
  using Zb = pl::ZeroBubbleH1<pl::microbatches<8>>;
  EXPECT_EQ((pl::static_program<Zb, 4>().ranks.size()), 4U);
}

}  // namespace
