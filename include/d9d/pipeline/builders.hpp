// d9d/pipeline/builders.hpp — constexpr functions that build compute-only schedule programs.
//
//   const auto p = d9d::pipeline::interleaved_1f1b(/*pp=*/4, /*stages_per_rank=*/2, /*m=*/8);
//   static_assert(d9d::pipeline::zero_bubble_v(/*pp=*/4, /*m=*/8).ranks.size() == 4);
//
// Each builder is a function of (pipeline degree, stages per rank, microbatches). Invalid sizes
// throw std::invalid_argument (a compile error when evaluated at compile time; the schedule
// policies check the same rules with static_assert messages first).
//
//   inference        forward only, breadth-first over each rank's stages
//   gpipe            all forwards, then all backwards (one stage per rank)
//   looped_bfs       GPipe over several stages per rank (round robin), breadth-first
//   one_f_one_b      warm-up forwards, then one forward / one backward, then cool-down
//   interleaved_1f1b 1F1B over several stages per rank (round robin); microbatches % pp == 0
//   zero_bubble_h1   1F1B with the backward split into input (I) and weight (W) gradients; W is
//                    delayed into the bubbles; the activation memory of 1F1B (ZB1P / ZB-H1)
//   zero_bubble_v    split backward on V-placed stages (two per rank), W filling the bubbles (ZBV)
//   dual_pipe_v      DeepSeek's DualPipeV: V-placed stages, the forward of one chunk paired with
//                    the backward of the other, W deferred where it fills the start and the end
//
// The zero-bubble builders place actions by list scheduling under unit costs (F = I = W = 1):
// each rank, when free, runs the ready action with the highest priority — the input-gradient
// I that unblocks the previous stage, then a forward while under the rank's activation limit, then
// a weight-gradient W. The resulting order is a valid program for any real costs.
#pragma once

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <d9d/pipeline/program.hpp>

namespace d9d::pipeline {
namespace detail {

constexpr Program empty_program(int pp, int stages_per_rank, int microbatches, Placement placement,
                                bool split, bool forward_only) {
  if (pp < 1) {
    throw std::invalid_argument("d9d::pipeline: the pipeline degree must be >= 1");
  }
  if (stages_per_rank < 1) {
    throw std::invalid_argument("d9d::pipeline: stages per rank must be >= 1");
  }
  if (microbatches < 1) {
    throw std::invalid_argument("d9d::pipeline: microbatches must be >= 1");
  }
  Program program{.pp = pp,
                  .stages_per_rank = stages_per_rank,
                  .microbatches = microbatches,
                  .placement = placement,
                  .split_backward = split,
                  .forward_only = forward_only,
                  .ranks = {}};
  program.ranks.resize(static_cast<std::size_t>(pp));
  return program;
}

constexpr Action compute(Op op, int stage, int microbatch) {
  return Action{.op = op, .stage = stage, .microbatch = microbatch, .peer = -1};
}

}  // namespace detail

/// Forward only: each rank runs its stages in order, every microbatch of a stage at once.
constexpr Program inference(int pp, int microbatches, int stages_per_rank = 1) {
  auto program =
      detail::empty_program(pp, stages_per_rank, microbatches, Placement::loop, false, true);
  for (int rank = 0; rank < pp; ++rank) {
    for (const int stage : rank_stages(Placement::loop, pp, stages_per_rank, rank)) {
      for (int mb = 0; mb < microbatches; ++mb) {
        program.ranks[static_cast<std::size_t>(rank)].push_back(
            detail::compute(Op::forward, stage, mb));
      }
    }
  }
  return program;
}

/// Breadth-first over several stages per rank: all forwards stage by stage, then all backwards in
/// reverse stage order.
constexpr Program looped_bfs(int pp, int stages_per_rank, int microbatches) {
  auto program =
      detail::empty_program(pp, stages_per_rank, microbatches, Placement::loop, false, false);
  for (int rank = 0; rank < pp; ++rank) {
    auto& actions = program.ranks[static_cast<std::size_t>(rank)];
    const auto stages = rank_stages(Placement::loop, pp, stages_per_rank, rank);
    for (const int stage : stages) {
      for (int mb = 0; mb < microbatches; ++mb) {
        actions.push_back(detail::compute(Op::forward, stage, mb));
      }
    }
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      for (int mb = 0; mb < microbatches; ++mb) {
        actions.push_back(detail::compute(Op::backward, *it, mb));
      }
    }
  }
  return program;
}

/// GPipe: all forwards, then all backwards.
constexpr Program gpipe(int pp, int microbatches) { return looped_bfs(pp, 1, microbatches); }

/// Interleaved 1F1B (1F1B when stages_per_rank is 1): per rank, warm-up forwards, then alternate
/// one forward and one backward, then the remaining backwards. With several stages per rank the
/// microbatches go through a rank's stages in groups of pp.
constexpr Program interleaved_1f1b(int pp, int stages_per_rank, int microbatches) {
  auto program =
      detail::empty_program(pp, stages_per_rank, microbatches, Placement::loop, false, false);
  const int v = stages_per_rank;
  if (v > 1 && microbatches % pp != 0) {
    throw std::invalid_argument(
        "d9d::pipeline::interleaved_1f1b: microbatches must be a multiple of the pipeline degree "
        "when a rank holds several stages");
  }
  const int total = microbatches * v;
  for (int rank = 0; rank < pp; ++rank) {
    auto& actions = program.ranks[static_cast<std::size_t>(rank)];
    // The k-th forward / backward of this rank: stage chunk and microbatch.
    const auto nth = [&](int k, bool backward) {
      const int within = k % (pp * v);
      const int chunk = backward ? v - 1 - within / pp : within / pp;
      const int mb = (k / (pp * v)) * pp + within % pp;
      return std::pair<int, int>{chunk * pp + rank, mb};
    };
    const int warmup = v == 1 ? std::min(pp - rank - 1, microbatches)
                              : std::min((pp - rank - 1) * 2 + (v - 1) * pp, total);
    for (int k = 0; k < warmup; ++k) {
      const auto [stage, mb] = nth(k, false);
      actions.push_back(detail::compute(Op::forward, stage, mb));
    }
    for (int k = 0; k < total - warmup; ++k) {
      const auto [fs, fm] = nth(warmup + k, false);
      actions.push_back(detail::compute(Op::forward, fs, fm));
      const auto [bs, bm] = nth(k, true);
      actions.push_back(detail::compute(Op::backward, bs, bm));
    }
    for (int k = total - warmup; k < total; ++k) {
      const auto [stage, mb] = nth(k, true);
      actions.push_back(detail::compute(Op::backward, stage, mb));
    }
  }
  return program;
}

/// 1F1B: one stage per rank.
constexpr Program one_f_one_b(int pp, int microbatches) {
  return interleaved_1f1b(pp, 1, microbatches);
}

namespace detail {

/// List scheduling of a split-backward program under unit costs (see the file comment).
/// `activation_limit[r]`: most microbatch-stages whose forward ran but whose I did not, on rank r.
constexpr Program list_schedule(Program program, const std::vector<int>& activation_limit) {
  const int pp = program.pp;
  const int stages = program.stages();
  const int m = program.microbatches;
  const auto index = [&](int stage, int mb) { return static_cast<std::size_t>(stage * m + mb); };
  constexpr int kNotYet = -1;
  // End times of F and I per (stage, microbatch); W only needs its own I.
  std::vector<int> f_end(static_cast<std::size_t>(stages * m), kNotYet);
  std::vector<int> i_end(static_cast<std::size_t>(stages * m), kNotYet);
  std::vector<char> w_done(static_cast<std::size_t>(stages * m), false);
  std::vector<int> busy_until(static_cast<std::size_t>(pp), 0);
  std::vector<int> live(static_cast<std::size_t>(pp), 0);  // F done, I not yet
  std::vector<std::vector<int>> owned(static_cast<std::size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    owned[static_cast<std::size_t>(r)] =
        rank_stages(program.placement, pp, program.stages_per_rank, r);
  }
  const int total = 3 * stages * m;
  int scheduled = 0;
  for (int t = 0; scheduled < total; ++t) {
    if (t > 64 * total + 64) {
      throw std::logic_error("d9d::pipeline: list scheduling made no progress");
    }
    for (int r = 0; r < pp; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      if (busy_until[rr] > t) {
        continue;
      }
      // Candidates in priority order: I (highest stage first), F (highest stage first, under the
      // activation limit), W (oldest first).
      Action best{};
      bool found = false;
      const auto& mine = owned[rr];
      for (auto it = mine.rbegin(); it != mine.rend() && !found; ++it) {
        const int s = *it;
        for (int mb = 0; mb < m && !found; ++mb) {
          const auto k = index(s, mb);
          const bool forward_done = f_end[k] != kNotYet && f_end[k] <= t;
          const bool grad_ready = s == stages - 1 || (i_end[index(s + 1, mb)] != kNotYet &&
                                                      i_end[index(s + 1, mb)] <= t);
          if (i_end[k] == kNotYet && forward_done && grad_ready) {
            best = compute(Op::backward_input, s, mb);
            found = true;
          }
        }
      }
      if (!found && live[rr] < activation_limit[rr]) {
        for (auto it = mine.rbegin(); it != mine.rend() && !found; ++it) {
          const int s = *it;
          for (int mb = 0; mb < m && !found; ++mb) {
            const bool input_ready =
                s == 0 || (f_end[index(s - 1, mb)] != kNotYet && f_end[index(s - 1, mb)] <= t);
            if (f_end[index(s, mb)] == kNotYet && input_ready) {
              best = compute(Op::forward, s, mb);
              found = true;
            }
          }
        }
      }
      if (!found) {
        int oldest = kNotYet;
        for (const int s : mine) {
          for (int mb = 0; mb < m; ++mb) {
            const auto k = index(s, mb);
            if (!w_done[k] && i_end[k] != kNotYet && i_end[k] <= t &&
                (oldest == kNotYet || i_end[k] < oldest)) {
              oldest = i_end[k];
              best = compute(Op::backward_weight, s, mb);
              found = true;
            }
          }
        }
      }
      if (!found) {
        continue;
      }
      const auto k = index(best.stage, best.microbatch);
      if (best.op == Op::forward) {
        f_end[k] = t + 1;
        ++live[rr];
      } else if (best.op == Op::backward_input) {
        i_end[k] = t + 1;
        --live[rr];
      } else {
        w_done[k] = true;
      }
      busy_until[rr] = t + 1;
      program.ranks[rr].push_back(best);
      ++scheduled;
    }
  }
  return program;
}

}  // namespace detail

/// ZB-H1 (ZB1P): 1F1B's order and activation memory with the backward split into I and W, the
/// W's filling the bubbles. One stage per rank.
constexpr Program zero_bubble_h1(int pp, int microbatches) {
  auto program = detail::empty_program(pp, 1, microbatches, Placement::loop, true, false);
  std::vector<int> limit;
  for (int r = 0; r < pp; ++r) {
    limit.push_back(pp - r);  // what 1F1B keeps alive on rank r
  }
  return detail::list_schedule(program, limit);
}

/// ZBV: two stages per rank in a V (rank r holds stages r and 2 pp - 1 - r), split backward, W's
/// filling the bubbles; each rank keeps at most 2 pp half-size stage activations alive (1F1B's
/// memory on rank 0).
constexpr Program zero_bubble_v(int pp, int microbatches) {
  auto program = detail::empty_program(pp, 2, microbatches, Placement::v, true, false);
  return detail::list_schedule(program, std::vector<int>(static_cast<std::size_t>(pp), 2 * pp));
}

/// DualPipeV (DeepSeek's DualPipe "cut in half"): two V-placed stages per rank — chunk 0 of rank r
/// is stage r, chunk 1 is stage 2 pp - 1 - r — and split backward. Rank r runs DeepSeek's eight
/// phases: 2 (pp - r - 1) forwards of chunk 0; r + 1 pairs F0 F1; pp - r - 1 times B1 W F1 with the
/// weight part of B1 deferred; the steady m - 2 pp + r + 1 groups F0 B1 F1 B0; pp - r - 1 times
/// B1 F1 B0; r + 1 pairs B1 B0 whose second half defers W; pp - r - 1 times W B0 (deferred); and
/// the last r + 1 W's. A full backward B is written as I immediately followed by W; a deferred one
/// as I, its W queued (FIFO) until a W phase. Needs microbatches >= 2 pp.
constexpr Program dual_pipe_v(int pp, int microbatches) {
  auto program = detail::empty_program(pp, 2, microbatches, Placement::v, true, false);
  if (microbatches < 2 * pp) {
    throw std::invalid_argument(
        "d9d::pipeline::dual_pipe_v: needs microbatches >= 2 x the pipeline degree (got " +
        std::to_string(microbatches) + " < 2 x " + std::to_string(pp) +
        "). Fix: raise the microbatches to at least " + std::to_string(2 * pp) +
        ", or use zero_bubble_v");
  }
  const int p = pp;
  const int m = microbatches;
  for (int r = 0; r < p; ++r) {
    auto& actions = program.ranks[static_cast<std::size_t>(r)];
    const std::array<int, 2> stage{r, 2 * p - 1 - r};
    std::array<int, 2> next_forward{0, 0};
    std::array<int, 2> next_backward{0, 0};
    std::vector<std::pair<int, int>> weights;  // deferred W's: (stage, microbatch), FIFO
    std::size_t weights_front = 0;
    const auto forward = [&](int chunk) {
      const auto c = static_cast<std::size_t>(chunk);
      actions.push_back(detail::compute(Op::forward, stage[c], next_forward[c]++));
    };
    const auto backward = [&](int chunk, bool defer_weight) {
      const auto c = static_cast<std::size_t>(chunk);
      const int mb = next_backward[c]++;
      actions.push_back(detail::compute(Op::backward_input, stage[c], mb));
      if (defer_weight) {
        weights.emplace_back(stage[c], mb);
      } else {
        actions.push_back(detail::compute(Op::backward_weight, stage[c], mb));
      }
    };
    const auto weight = [&] {
      if (weights_front == weights.size()) {
        throw std::logic_error("d9d::pipeline::dual_pipe_v: no deferred weight gradient to run");
      }
      const auto [s, mb] = weights[weights_front++];
      actions.push_back(detail::compute(Op::backward_weight, s, mb));
    };
    for (int i = 0; i < 2 * (p - r - 1); ++i) {  // 1: nF0
      forward(0);
    }
    for (int i = 0; i < r + 1; ++i) {  // 2: nF0F1
      forward(0);
      forward(1);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 3: nB1W1F1, zero bubble
      backward(1, true);
      weight();
      forward(1);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {  // 4: nF0B1F1B0, the steady state
      forward(0);
      backward(1, false);
      forward(1);
      backward(0, false);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 5: nB1F1B0
      backward(1, false);
      forward(1);
      backward(0, false);
    }
    bool defer = false;  // 6: nB1B0, the second half defers W
    const int step6 = r + 1;
    for (int i = 0; i < step6; ++i) {
      if (i == step6 / 2 && r % 2 == 1) {
        defer = true;
      }
      backward(1, defer);
      if (i == step6 / 2 && r % 2 == 0) {
        defer = true;
      }
      backward(0, defer);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 7: nWB0, zero bubble
      weight();
      backward(0, true);
    }
    for (int i = 0; i < r + 1; ++i) {  // 8: nW
      weight();
    }
    if (weights_front != weights.size()) {
      throw std::logic_error("d9d::pipeline::dual_pipe_v: weight gradients left in the queue");
    }
  }
  return program;
}

}  // namespace d9d::pipeline
