// Pipeline schedules as programs: every builder verifies (at compile time for a few sizes, at run
// time for the grid, under the executor's rendezvous model of batched sends and receives), bubble
// fractions match the known formulas, memory matches 1F1B where the schedule promises it, and
// verify() catches each rule on deliberately broken programs.
#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/pipeline/pairs.hpp>
#include <d9d/pipeline/picture.hpp>
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
static_assert(pl::verify(pl::with_communication(pl::dual_pipe_v(4, 8))).ok());
static_assert(pl::verify(pl::with_communication(pl::looped_bfs(2, 3, 4))).ok());
static_assert(pl::verify(pl::with_communication(pl::inference(4, 4))).ok());
static_assert(pl::verify(pl::group_pairs(pl::with_communication(pl::dual_pipe_v(4, 8)))).ok());
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
  if (name == "DualPipeV") {
    return pl::dual_pipe_v(pp, m);
  }
  return pl::inference(pp, m);
}

std::string describe(const pl::Verdict& verdict) {
  return std::string(pl::to_string(verdict.rule)) + " rank " + std::to_string(verdict.rank) + " " +
         pl::to_string(verdict.action);
}

class Pipeline_Schedule : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(Pipeline_Schedule, VerifiesWithAndWithoutCommunication) {
  const auto& [name, pp, m] = GetParam();
  if (name == "Interleaved1F1B_v2" && m % pp != 0) {
    GTEST_SKIP() << "interleaved 1F1B needs m % pp == 0";
  }
  if (name == "DualPipeV" && m < 2 * pp) {
    GTEST_SKIP() << "DualPipeV needs m >= 2 pp";
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
                                         "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV", "Inference"),
                       ::testing::Values(2, 4, 8), ::testing::Values(1, 2, 4, 8, 16)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_pp" + std::to_string(std::get<1>(info.param)) + "_mb" +
             std::to_string(std::get<2>(info.param));
    });

// Every built-in schedule, pp 1..8 and every valid microbatch count up to 4 pp, passes verify()
// with communication: FIFO order between each pair of ranks, no deadlock with each run of sends
// and receives posted as one batch that completes only when the peers post the matching operations.
TEST(Pipeline_AllSchedules_pp1to8_mbTo4pp, VerifyUnderRendezvous) {
  const std::vector<std::string> names = {"Inference",    "GPipe",       "LoopedBfs_v2",
                                          "LoopedBfs_v3", "OneFOneB",    "Interleaved1F1B_v2",
                                          "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV"};
  int checked = 0;
  for (const auto& name : names) {
    for (int pp = 1; pp <= 8; ++pp) {
      for (int m = 1; m <= 4 * pp; ++m) {
        if ((name == "OneFOneB" && m < pp) || (name == "Interleaved1F1B_v2" && m % pp != 0) ||
            (name == "DualPipeV" && m < 2 * pp)) {
          continue;
        }
        const auto program = name == "LoopedBfs_v3" ? pl::looped_bfs(pp, 3, m) : build(name, pp, m);
        const auto verdict = pl::verify(pl::with_communication(program));
        EXPECT_TRUE(verdict.ok()) << name << " pp " << pp << " mb " << m << ": "
                                  << describe(verdict);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 700);
}

// DualPipeV: F, I and W of every (stage, microbatch) on its V rank, in an order that verifies, for
// the sizes around its minimum of 2 pp microbatches; 2 pp + 1 half-stage activations on every rank.
TEST(Pipeline_DualPipeV_pp1to8, VerifiesWithCommunication) {
  for (int pp = 1; pp <= 8; ++pp) {
    for (const int m : {2 * pp, 2 * pp + 1, 3 * pp, 4 * pp}) {
      const auto program = pl::dual_pipe_v(pp, m);
      EXPECT_EQ(program.stages_per_rank, 2);
      EXPECT_EQ(program.placement, pl::Placement::v);
      EXPECT_TRUE(program.split_backward);
      const auto verdict = pl::verify(pl::with_communication(program));
      ASSERT_TRUE(verdict.ok()) << "pp " << pp << " mb " << m << ": " << describe(verdict);
      for (const int peak : verdict.peak_activations) {
        EXPECT_EQ(peak, 2 * pp + 1) << "pp " << pp << " mb " << m;
      }
    }
  }
  // Rank 0 of pp 2: 2 (pp - 1) forwards of chunk 0, F0 F1 once, B1 W F1 with the W deferred, ...
  const auto small = pl::dual_pipe_v(2, 4);
  std::string rank0;
  for (const auto& a : small.ranks[0]) {
    rank0 += pl::to_string(a) + " ";
  }
  EXPECT_EQ(
      rank0,
      "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3I1 3W1 3F2 0I0 0W0 3I2 3W2 3F3 0I1 0W1 3I3 3W3 0I2 0W2 "
      "0I3 0W3 ");
  EXPECT_THROW((void)pl::dual_pipe_v(4, 7), std::invalid_argument);
}

// ---- pairs: a forward and another stage's backward at once (d9d/pipeline/pairs.hpp) -------------

// The actions of a rank as sorted strings: the same multiset before and after regrouping.
std::vector<std::string> sorted_names(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  out.reserve(actions.size());
  for (const auto& a : actions) {
    out.push_back(pl::to_string(a));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Action> compute_only(const std::vector<Action>& actions) {
  std::vector<Action> out;
  std::copy_if(actions.begin(), actions.end(), std::back_inserter(out),
               [](const Action& a) { return a.is_compute(); });
  return out;
}

// DualPipeV regrouped: it still verifies, every rank keeps its actions and its compute order, and
// every forward followed (in compute order) by the other chunk's backward is a pair: two per
// steady-state group F0 B1 F1 B0 at least.
TEST(Pipeline_Pairs_pp1to8, DualPipeVRegroupedVerifiesAndPairsEveryCandidate) {
  for (int pp = 1; pp <= 8; ++pp) {
    for (const int m : {2 * pp, 2 * pp + 1, 3 * pp, 4 * pp}) {
      const auto program = pl::with_communication(pl::dual_pipe_v(pp, m));
      const auto grouped = pl::group_pairs(program);
      const auto verdict = pl::verify(grouped);
      ASSERT_TRUE(verdict.ok()) << "pp " << pp << " mb " << m << ": " << describe(verdict);
      for (int r = 0; r < pp; ++r) {
        const auto& before = program.ranks[static_cast<std::size_t>(r)];
        const auto& after = grouped.ranks[static_cast<std::size_t>(r)];
        EXPECT_EQ(sorted_names(before), sorted_names(after)) << "pp " << pp << " rank " << r;
        const auto computed = compute_only(before);
        EXPECT_EQ(computed, compute_only(after)) << "pp " << pp << " rank " << r;
        int candidates = 0;
        for (std::size_t i = 0; i + 1 < computed.size(); ++i) {
          candidates += pl::pair_at(computed, i) ? 1 : 0;
        }
        int pairs = 0;
        for (std::size_t i = 0; i < after.size(); ++i) {
          pairs += pl::pair_at(after, i) ? 1 : 0;
        }
        EXPECT_EQ(pairs, candidates) << "pp " << pp << " mb " << m << " rank " << r;
        EXPECT_GE(pairs, 2 * (m - 2 * pp + r + 1)) << "pp " << pp << " mb " << m << " rank " << r;
      }
    }
  }
  // Rank 0 of pp 2, m 4: the send of 0F3's output moves after 3I1 (stage 3, the last, gets its
  // gradient from the loss), and the receive of 0I0's gradient stands before 3F2.
  const auto grouped = pl::group_pairs(pl::with_communication(pl::dual_pipe_v(2, 4)));
  std::string rank0;
  for (const auto& a : grouped.ranks[0]) {
    rank0 += pl::to_string(a) + " ";
  }
  EXPECT_THAT(rank0, ::testing::HasSubstr(" 0F3 3I1 0SA3>1 "));
  EXPECT_THAT(rank0, ::testing::HasSubstr(" 0RG0<1 3F2 0I0 "));
}

// A forward and a backward of the same stage never pair, nor does a backward and a forward; a
// program with one stage per rank is unchanged, and every training schedule still verifies once
// regrouped (the executor's overlap_pairs takes any of them).
TEST(Pipeline_Pairs, OnlyAForwardThenAnotherStagesBackwardPairs) {
  const std::vector<Action> same{{.op = Op::forward, .stage = 1, .microbatch = 0},
                                 {.op = Op::backward_input, .stage = 1, .microbatch = 0}};
  EXPECT_FALSE(pl::pair_at(same, 0));
  const std::vector<Action> reversed{{.op = Op::backward, .stage = 2, .microbatch = 0},
                                     {.op = Op::forward, .stage = 1, .microbatch = 1}};
  EXPECT_FALSE(pl::pair_at(reversed, 0));
  const std::vector<Action> weight{{.op = Op::forward, .stage = 1, .microbatch = 1},
                                   {.op = Op::backward_weight, .stage = 2, .microbatch = 0}};
  EXPECT_FALSE(pl::pair_at(weight, 0));
  const std::vector<Action> other{{.op = Op::forward, .stage = 1, .microbatch = 1},
                                  {.op = Op::backward, .stage = 2, .microbatch = 0}};
  EXPECT_TRUE(pl::pair_at(other, 0));
  EXPECT_FALSE(pl::pair_at(other, 1));
  const auto one = pl::with_communication(pl::one_f_one_b(4, 8));
  EXPECT_EQ(pl::group_pairs(one).ranks, one.ranks);
  int checked = 0;
  for (const std::string name : {"GPipe", "OneFOneB", "Interleaved1F1B_v2", "LoopedBfs_v2",
                                 "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV"}) {
    for (int pp = 1; pp <= 4; ++pp) {
      for (const int m : {2 * pp, 4 * pp}) {
        const auto grouped = pl::group_pairs(pl::with_communication(build(name, pp, m)));
        const auto verdict = pl::verify(grouped);
        EXPECT_TRUE(verdict.ok()) << name << " pp " << pp << " mb " << m << ": "
                                  << describe(verdict);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 56);
}

// ---- the executor's batches under NCCL's ordering ---------------------------------------------
//
// A model of what the executor posts and of how NCCL runs it, to check every program for
// deadlocks the way the GPUs see it (verify()'s model has each operation of a batch complete on
// its own). Per rank, compute units (an action, or a pair with overlap_pairs) run in order on the
// compute stream, each once the batches receiving its inputs completed (all batches posted before
// it when sends and receives are waited for at once); batches run in posting order on the
// communication stream, each once the compute issued before it finished (its sends read that
// compute's outputs). Within a batch, the operations with one peer run in steps, each the next
// send and the next receive, a step once the previous one completed: a second send waits for the
// first receive. A send and its receive (the i-th from a to b and the i-th b receives from a)
// complete together, once both are ready (rendezvous). The executor splits a run of
// communication before a second send (or receive) with the same peer (Executor::enqueue);
// `split` switches that off to show the deadlock it prevents.
namespace nccl_model {

struct P2P {
  bool send = false;
  int peer = 0;
  int message = 0;  // its index among the messages between the two ranks, in that direction
  int step = 0;     // its step within its batch
  bool done = false;
};
struct Batch {
  std::vector<P2P> ops;
  std::size_t after_units = 0;  // compute units issued before it was posted
};
struct Rank {
  std::vector<Batch> batches;
  std::vector<std::vector<std::size_t>> unit_waits;  // per unit: the batches it waits for
  std::size_t units_done = 0;
  std::size_t batches_done = 0;
};

struct Options {
  bool pairs = false;
  bool overlap = true;  // compute waits only for the batches receiving its inputs
  bool split = true;
};

inline std::vector<Rank> post(const Program& program, const Options& options) {
  const int pp = program.pp;
  std::vector<Rank> ranks(static_cast<std::size_t>(pp));
  std::vector<std::vector<int>> sent(static_cast<std::size_t>(pp), std::vector<int>(pp, 0));
  std::vector<std::vector<int>> received = sent;
  for (int r = 0; r < pp; ++r) {
    auto& rank = ranks[static_cast<std::size_t>(r)];
    const auto& actions = program.ranks[static_cast<std::size_t>(r)];
    Batch current;
    std::map<std::tuple<bool, int, int>, std::size_t> receiving;  // (gradient, stage, mb) -> batch
    std::vector<std::tuple<bool, int, int>> unposted;
    const auto flush = [&] {
      if (current.ops.empty()) {
        return;
      }
      for (const auto& key : unposted) {
        receiving[key] = rank.batches.size();
      }
      unposted.clear();
      current.after_units = rank.unit_waits.size();
      std::map<std::pair<bool, int>, int> steps;
      for (auto& op : current.ops) {
        op.step = steps[{op.send, op.peer}]++;
      }
      rank.batches.push_back(std::move(current));
      current = {};
    };
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (!a.is_compute()) {
        const bool send = a.op == Op::send_activation || a.op == Op::send_gradient;
        const bool repeats = std::any_of(current.ops.begin(), current.ops.end(), [&](const P2P& o) {
          return o.send == send && o.peer == a.peer;
        });
        if (options.split && repeats) {
          flush();
        }
        auto& count = (send ? sent : received)[static_cast<std::size_t>(send ? r : a.peer)]
                                              [static_cast<std::size_t>(send ? a.peer : r)];
        current.ops.push_back({.send = send, .peer = a.peer, .message = count++});
        if (!send) {
          unposted.emplace_back(a.op == Op::recv_gradient, a.stage, a.microbatch);
        }
        continue;
      }
      flush();
      std::vector<Action> unit{a};
      if (options.pairs && pl::pair_at(actions, i)) {
        unit.push_back(actions[++i]);
      }
      std::vector<std::size_t> waits;
      if (!options.overlap) {
        for (std::size_t b = 0; b < rank.batches.size(); ++b) {
          waits.push_back(b);
        }
      }
      for (const auto& u : unit) {
        const bool gradient = u.op == Op::backward || u.op == Op::backward_input;
        const auto it = receiving.find({gradient, u.stage, u.microbatch});
        if ((u.op == Op::forward || gradient) && it != receiving.end()) {
          waits.push_back(it->second);
        }
      }
      rank.unit_waits.push_back(waits);
    }
    flush();
  }
  return ranks;
}

// Runs the ranks until none can go on; "" when all finished, else where each rank stopped.
inline std::string run(std::vector<Rank> ranks) {
  const auto active = [&](Rank& rank) -> Batch* {
    if (rank.batches_done >= rank.batches.size()) {
      return nullptr;
    }
    auto& batch = rank.batches[rank.batches_done];
    return batch.after_units <= rank.units_done ? &batch : nullptr;
  };
  const auto ready = [](const Batch& batch, const P2P& op) {
    return std::all_of(batch.ops.begin(), batch.ops.end(), [&](const P2P& other) {
      return other.peer != op.peer || other.step >= op.step || other.done;
    });
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      auto& rank = ranks[r];
      while (rank.units_done < rank.unit_waits.size() &&
             std::all_of(rank.unit_waits[rank.units_done].begin(),
                         rank.unit_waits[rank.units_done].end(),
                         [&](std::size_t b) { return b < rank.batches_done; })) {
        ++rank.units_done;
        progress = true;
      }
      Batch* batch = active(rank);
      if (batch == nullptr) {
        continue;
      }
      for (auto& op : batch->ops) {
        if (op.done || !op.send || !ready(*batch, op)) {
          continue;
        }
        Batch* other = active(ranks[static_cast<std::size_t>(op.peer)]);
        if (other == nullptr) {
          continue;
        }
        for (auto& match : other->ops) {
          if (!match.send && match.peer == static_cast<int>(r) && match.message == op.message &&
              !match.done && ready(*other, match)) {
            op.done = match.done = true;
            progress = true;
          }
        }
      }
      if (std::all_of(batch->ops.begin(), batch->ops.end(), [](const P2P& o) { return o.done; })) {
        ++rank.batches_done;
        progress = true;
      }
    }
  }
  std::string stuck;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& rank = ranks[r];
    if (rank.units_done < rank.unit_waits.size() || rank.batches_done < rank.batches.size()) {
      stuck += "rank " + std::to_string(r) + " at unit " + std::to_string(rank.units_done) + "/" +
               std::to_string(rank.unit_waits.size()) + ", batch " +
               std::to_string(rank.batches_done) + "/" + std::to_string(rank.batches.size()) + "; ";
    }
  }
  return stuck;
}

}  // namespace nccl_model

// Every training schedule's program, as the executor posts it (with and without overlap_pairs'
// regrouping, sends overlapped or waited for at once), finishes under NCCL's ordering. Without
// the executor's split, interleaved 1F1B's pairs at pp 2, m 4 deadlock there: two sends to the
// same peer in one group, the second waiting for the group's receive, which the peer sends only
// after it received the second (the hang NCCL showed on two H200s).
TEST(Pipeline_NcclModel, EveryProgramAsTheExecutorPostsItFinishes) {
  int checked = 0;
  for (const std::string name : {"GPipe", "OneFOneB", "Interleaved1F1B_v2", "LoopedBfs_v2",
                                 "ZeroBubbleH1", "ZeroBubbleV", "DualPipeV"}) {
    for (int pp = 2; pp <= 4; ++pp) {
      for (const int m : {2 * pp, 4 * pp}) {
        const auto program = pl::with_communication(build(name, pp, m));
        for (const bool overlap : {true, false}) {
          const auto where = name + " pp " + std::to_string(pp) + " mb " + std::to_string(m) +
                             (overlap ? ", overlapped" : ", waited at once");
          EXPECT_EQ(nccl_model::run(nccl_model::post(program, {.overlap = overlap})), "") << where;
          EXPECT_EQ(nccl_model::run(nccl_model::post(pl::group_pairs(program),
                                                     {.pairs = true, .overlap = overlap})),
                    "")
              << where << ", pairs";
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 84);
  const auto interleaved =
      pl::group_pairs(pl::with_communication(build("Interleaved1F1B_v2", 2, 4)));
  EXPECT_EQ(nccl_model::run(nccl_model::post(interleaved, {.pairs = true})), "");
  EXPECT_THAT(nccl_model::run(nccl_model::post(interleaved, {.pairs = true, .split = false})),
              ::testing::HasSubstr("rank 0 at unit"));
}

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
  // DualPipeV (all sizes here have m >= 2 p): ZBV's bubble, half of ZB-H1's or less.
  const double dual = bubble(pl::dual_pipe_v(pp, m));
  EXPECT_NEAR(dual, (p - 1) / (6 * mb + p - 1), 1e-12);
  EXPECT_LT(dual, h1);
}

INSTANTIATE_TEST_SUITE_P(Sizes, Pipeline_Bubble,
                         ::testing::Values(std::make_tuple(2, 4), std::make_tuple(2, 8),
                                           std::make_tuple(4, 8), std::make_tuple(4, 16),
                                           std::make_tuple(8, 16), std::make_tuple(8, 32)),
                         [](const auto& info) {
                           return "pp" + std::to_string(std::get<0>(info.param)) + "_mb" +
                                  std::to_string(std::get<1>(info.param));
                         });

// DualPipeV against ZB-H1 at the same sizes, pp 1..8, every m from 2 pp to 4 pp: with F = I = W its
// only idle time is the last rank's start-up wait, (p - 1) units of 6 m + p - 1, which is at most
// ZB-H1's (p - 1) / (3 m + p - 1) (equal only for pp = 1, where both are 0).
TEST(Pipeline_DualPipeV_pp1to8_mb2ppTo4pp, BubbleNoWorseThanZeroBubbleH1) {
  for (int pp = 1; pp <= 8; ++pp) {
    for (int m = 2 * pp; m <= 4 * pp; ++m) {
      const double p = pp;
      const double mb = m;
      const auto dual = pl::simulate(pl::with_communication(pl::dual_pipe_v(pp, m)), kUnit);
      const auto h1 = pl::simulate(pl::with_communication(pl::zero_bubble_h1(pp, m)), kUnit);
      EXPECT_NEAR(dual.makespan, 6 * mb + p - 1, 1e-12) << "pp " << pp << " mb " << m;
      EXPECT_NEAR(dual.bubble_fraction(), (p - 1) / (6 * mb + p - 1), 1e-12)
          << "pp " << pp << " mb " << m;
      EXPECT_LE(dual.bubble_fraction(), h1.bubble_fraction() + 1e-12) << "pp " << pp << " mb " << m;
    }
  }
}

// Each stage's own costs: equal ones are simulate's. 1F1B over 2 stages and 2 microbatches with
// stage 0 at F 1, B 2 and stage 1 at F 3, B 4: rank 0 runs F0 [0, 1], F1 [1, 2]; rank 1 F0
// [1, 4], B0 [4, 8], F1 [8, 11], B1 [11, 15]; rank 0 then B0 [8, 10] and B1 [15, 17].
TEST(Pipeline_Simulate, EachStageAtItsOwnCosts) {
  for (const auto& program : {pl::with_communication(pl::one_f_one_b(2, 4)),
                              pl::with_communication(pl::zero_bubble_h1(2, 4)),
                              pl::with_communication(pl::dual_pipe_v(2, 4))}) {
    const pl::Costs costs{.forward = 2, .backward_input = 3, .backward_weight = 1};
    const auto same = pl::simulate_stages(
        program, std::vector<pl::Costs>(static_cast<std::size_t>(program.stages()), costs));
    EXPECT_DOUBLE_EQ(same.makespan, pl::simulate(program, costs).makespan);
    EXPECT_DOUBLE_EQ(same.bubble_fraction(), pl::simulate(program, costs).bubble_fraction());
  }
  const auto program = pl::with_communication(pl::one_f_one_b(2, 2));
  const auto uneven =
      pl::simulate_stages(program, {{.forward = 1, .backward_input = 1, .backward_weight = 1},
                                    {.forward = 3, .backward_input = 2, .backward_weight = 2}});
  EXPECT_DOUBLE_EQ(uneven.makespan, 17.0);
  // Busy 1 + 1 + 2 + 2 on rank 0 and 3 + 4 + 3 + 4 on rank 1, of 2 x 17.
  EXPECT_DOUBLE_EQ(uneven.bubble_fraction(), 1.0 - 20.0 / 34.0);
  EXPECT_THAT(d9d::testing::error_of([&] { (void)pl::simulate_stages(program, {{}}); }),
              ::testing::HasSubstr("1 costs for 2 stages"));
}

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

// The picture of a timeline: one rect per compute action per rank, in the panels given.
TEST(Pipeline_Picture, OneRectPerActionPerRankAndPanel) {
  const auto program = pl::with_communication(pl::zero_bubble_h1(4, 8));
  const auto timeline = pl::simulate(program, {});
  const auto count = [](const std::string& text, const std::string& needle) {
    int n = 0;
    for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
      ++n;
    }
    return n;
  };
  const auto svg = pl::timeline_svg(
      {.title = "zb",
       .panels = {{.title = "", .timeline = timeline}, {.title = "again", .timeline = timeline}},
       .unit_width = 28});
  EXPECT_EQ(count(svg, R"(class="action")"), 2 * 4 * 8 * 3);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(count(svg, R"(data-panel="1" data-rank=")" + std::to_string(r) + "\""), 8 * 3);
  }
  EXPECT_EQ(count(svg, R"(data-action="3W7")"), 2);
  EXPECT_THAT(svg, ::testing::HasSubstr(">again<"));
  // Mean costs of a timeline: a full B counts half as I and half as W.
  const auto costs =
      pl::measured_costs(pl::simulate(pl::with_communication(pl::one_f_one_b(2, 4)),
                                      {.forward = 2, .backward_input = 3, .backward_weight = 1}));
  EXPECT_DOUBLE_EQ(costs.forward, 2.0);
  EXPECT_DOUBLE_EQ(costs.backward_input, 2.0);
  EXPECT_DOUBLE_EQ(costs.backward_weight, 2.0);
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
    // Rank 0 runs its backwards before its forwards: order rule first.
    auto p = pl::gpipe(2, 2);
    auto& rank0 = p.ranks[0];
    std::rotate(rank0.begin(), rank0.begin() + 2, rank0.end());  // B0 B1 F0 F1
    EXPECT_EQ(pl::verify(p).rule, Rule::order);
    // Rank 0 waits for the first gradient before sending the first activation: a cycle of waits.
    auto q = pl::with_communication(pl::gpipe(2, 2));
    auto& r0 = q.ranks[0];
    const auto recv = std::find_if(r0.begin(), r0.end(),
                                   [](const Action& a) { return a.op == Op::recv_gradient; });
    const Action moved = *recv;
    r0.erase(recv);
    r0.insert(r0.begin(), moved);
    const auto verdict = pl::verify(q);
    EXPECT_EQ(verdict.rule, Rule::deadlock);
    EXPECT_EQ(verdict.rank, 0);
    EXPECT_EQ(pl::to_string(verdict.action), "0RG0<1");
  }
}

Action act(Op op, int stage, int microbatch, int peer = -1) {
  return Action{.op = op, .stage = stage, .microbatch = microbatch, .peer = peer};
}

// NCCL matches the messages between two ranks by posting order: rank 1 receiving rank 0's second
// activation before its first is reported at that receive, even though each receive has its send.
TEST(Pipeline_Verify, ReceivesOutOfSendOrderBreakFifo) {
  auto p = pl::with_communication(pl::one_f_one_b(2, 4));
  auto& rank1 = p.ranks[1];
  const auto first = std::find(rank1.begin(), rank1.end(), act(Op::recv_activation, 1, 0, 0));
  const auto second = std::find(rank1.begin(), rank1.end(), act(Op::recv_activation, 1, 1, 0));
  ASSERT_NE(first, rank1.end());
  ASSERT_NE(second, rank1.end());
  EXPECT_TRUE(pl::verify(p).ok());
  std::iter_swap(first, second);
  const auto verdict = pl::verify(p);
  EXPECT_EQ(verdict.rule, Rule::fifo) << describe(verdict);
  EXPECT_EQ(verdict.rank, 1);
  EXPECT_EQ(pl::to_string(verdict.action), "1RA1<0");
}

// Sends block until the peer posts the receive. Rank 0 sends three activations, each in its own
// batch, before receiving a gradient; rank 1 sends gradient 0 (a batch of its own, W follows)
// before receiving activation 1. With non-blocking sends this runs; under rendezvous rank 0 waits
// in 0SA1 for rank 1, which waits in 1SG0 for rank 0. with_communication() places the same compute
// order's receives where the data is produced, and that verifies.
TEST(Pipeline_Verify, SendsWaitForTheirReceives) {
  Program p{.pp = 2,
            .stages_per_rank = 1,
            .microbatches = 3,
            .placement = pl::Placement::loop,
            .split_backward = true,
            .forward_only = false,
            .ranks = {}};
  p.ranks.resize(2);
  for (int mb = 0; mb < 3; ++mb) {
    p.ranks[0].push_back(act(Op::forward, 0, mb));
    p.ranks[0].push_back(act(Op::send_activation, 0, mb, 1));
  }
  for (int mb = 0; mb < 3; ++mb) {
    p.ranks[0].push_back(act(Op::recv_gradient, 0, mb, 1));
    p.ranks[0].push_back(act(Op::backward_input, 0, mb));
    p.ranks[0].push_back(act(Op::backward_weight, 0, mb));
    p.ranks[1].push_back(act(Op::recv_activation, 1, mb, 0));
    p.ranks[1].push_back(act(Op::forward, 1, mb));
    p.ranks[1].push_back(act(Op::backward_input, 1, mb));
    p.ranks[1].push_back(act(Op::send_gradient, 1, mb, 0));
    p.ranks[1].push_back(act(Op::backward_weight, 1, mb));
  }
  const auto verdict = pl::verify(p);
  EXPECT_EQ(verdict.rule, Rule::deadlock) << describe(verdict);
  EXPECT_EQ(verdict.rank, 0);
  EXPECT_EQ(pl::to_string(verdict.action), "0SA1>1");

  Program compute_only = p;
  for (auto& rank : compute_only.ranks) {
    rank.erase(
        std::remove_if(rank.begin(), rank.end(), [](const Action& a) { return !a.is_compute(); }),
        rank.end());
  }
  const auto fixed = pl::verify(pl::with_communication(compute_only));
  EXPECT_TRUE(fixed.ok()) << describe(fixed);
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
  EXPECT_THAT(
      d9d::testing::error_of<std::invalid_argument>(
          [] { (void)pl::build_program<pl::DualPipeV<>>(4, 6); }),
      ::testing::HasSubstr("needs microbatches >= 2 x the pipeline degree (got 6 < 2 x 4)"));
  EXPECT_EQ(pl::build_program<pl::ZeroBubbleV<>>(2, 4).ranks.size(), 2U);
  EXPECT_EQ(pl::build_program<pl::DualPipeV<>>(2, 4).ranks.size(), 2U);
  static_assert(pl::DualPipeV<>::stages_per_rank == 2 && pl::DualPipeV<>::split_backward &&
                pl::DualPipeV<>::placement == pl::Placement::v);
  EXPECT_EQ((pl::static_program<pl::DualPipeV<pl::microbatches<8>>, 4>().ranks.size()), 4U);
  using Zb = pl::ZeroBubbleH1<pl::microbatches<8>>;
  EXPECT_EQ((pl::static_program<Zb, 4>().ranks.size()), 4U);
}

}  // namespace
