// d9d/pipeline/verify.hpp — communication insertion, verification and timing of programs.
//
//   constexpr auto program = d9d::pipeline::with_communication(d9d::pipeline::one_f_one_b(4, 8));
//   static_assert(d9d::pipeline::verify(program).ok());
//   auto timeline = d9d::pipeline::simulate(program, {.forward = 1, .backward_input = 1,
//                                                     .backward_weight = 1});
//   timeline.bubble_fraction();   // (p - 1) / (m + p - 1) for 1F1B with B = 2 F
//
// verify() checks, in this order, and reports the first violation with its rank and action:
//   wrong_rank       an action for a stage that lives on another rank
//   missing/duplicate every (stage, microbatch) has exactly one F and one B (or one I and one W)
//   backward_kind    B in a split program, or I/W in an unsplit one, or any backward in inference
//   order            on a stage: F before its I/B, I before its W
//   unmatched        a send without its receive, a receive without its send (peers included)
//   deadlock         executing the programs with non-blocking sends and blocking receives stops
//                    (a compute step also waits for inputs computed on its own rank earlier)
// and measures the peak number of live activations (forwards whose I/B has not run) per rank.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <d9d/pipeline/program.hpp>

namespace d9d::pipeline {

/// Inserts the sends and receives the compute actions need: a receive right before a compute step
/// whose input lives on another rank, a send right after one whose output another rank needs.
constexpr Program with_communication(const Program& compute_only) {
  Program out = compute_only;
  const int pp = out.pp;
  const int last = out.stages() - 1;
  const auto rank_of = [&](int stage) { return stage_rank(out.placement, pp, stage); };
  for (int r = 0; r < pp; ++r) {
    std::vector<Action> actions;
    for (const auto& a : compute_only.ranks[static_cast<std::size_t>(r)]) {
      if (!a.is_compute()) {
        actions.push_back(a);
        continue;
      }
      const bool backward = a.op == Op::backward || a.op == Op::backward_input;
      if (a.op == Op::forward && a.stage > 0 && rank_of(a.stage - 1) != r) {
        actions.push_back({.op = Op::recv_activation,
                           .stage = a.stage,
                           .microbatch = a.microbatch,
                           .peer = rank_of(a.stage - 1)});
      }
      if (backward && a.stage < last && rank_of(a.stage + 1) != r) {
        actions.push_back({.op = Op::recv_gradient,
                           .stage = a.stage,
                           .microbatch = a.microbatch,
                           .peer = rank_of(a.stage + 1)});
      }
      actions.push_back(a);
      if (a.op == Op::forward && a.stage < last && rank_of(a.stage + 1) != r) {
        actions.push_back({.op = Op::send_activation,
                           .stage = a.stage,
                           .microbatch = a.microbatch,
                           .peer = rank_of(a.stage + 1)});
      }
      if (backward && a.stage > 0 && rank_of(a.stage - 1) != r) {
        actions.push_back({.op = Op::send_gradient,
                           .stage = a.stage,
                           .microbatch = a.microbatch,
                           .peer = rank_of(a.stage - 1)});
      }
    }
    out.ranks[static_cast<std::size_t>(r)] = std::move(actions);
  }
  return out;
}

/// The rules verify() checks, in order.
enum class Rule : std::uint8_t {
  none,
  wrong_rank,
  missing,
  duplicate,
  backward_kind,
  order,
  unmatched,
  deadlock,
};

/// What verify() found: the first violation (rank and action) and, when valid, peak memory.
struct Verdict {
  Rule rule = Rule::none;
  int rank = -1;
  Action action{};
  std::vector<int> peak_activations;  ///< per rank

  [[nodiscard]] constexpr bool ok() const { return rule == Rule::none; }
};

namespace detail {

constexpr bool is_backward(Op op) {
  return op == Op::backward || op == Op::backward_input || op == Op::backward_weight;
}

// The send that feeds a receive: activation of stage s comes from stage s - 1's send; the gradient
// received by stage s comes from stage s + 1's send.
constexpr Action matching_send(const Action& recv, int receiver) {
  if (recv.op == Op::recv_activation) {
    return {.op = Op::send_activation,
            .stage = recv.stage - 1,
            .microbatch = recv.microbatch,
            .peer = receiver};
  }
  return {.op = Op::send_gradient,
          .stage = recv.stage + 1,
          .microbatch = recv.microbatch,
          .peer = receiver};
}

}  // namespace detail

/// Checks a program (with or without communication actions); see the file comment.
constexpr Verdict verify(const Program& program) {
  const int pp = program.pp;
  const int stages = program.stages();
  const int m = program.microbatches;
  const auto index = [&](int stage, int mb) { return static_cast<std::size_t>(stage * m + mb); };
  const auto fail = [](Rule rule, int rank, const Action& action) {
    return Verdict{.rule = rule, .rank = rank, .action = action, .peak_activations = {}};
  };
  bool has_comm = false;

  // wrong_rank, duplicate, backward_kind
  std::vector<int> forwards(static_cast<std::size_t>(stages * m), 0);
  std::vector<int> fulls(static_cast<std::size_t>(stages * m), 0);
  std::vector<int> inputs(static_cast<std::size_t>(stages * m), 0);
  std::vector<int> weights(static_cast<std::size_t>(stages * m), 0);
  for (int r = 0; r < pp; ++r) {
    for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
      if (a.stage < 0 || a.stage >= stages || a.microbatch < 0 || a.microbatch >= m ||
          stage_rank(program.placement, pp, a.stage) != r) {
        return fail(Rule::wrong_rank, r, a);
      }
      if (!a.is_compute()) {
        has_comm = true;
        continue;
      }
      const bool bad_kind =
          (program.forward_only && detail::is_backward(a.op)) ||
          (program.split_backward && a.op == Op::backward) ||
          (!program.split_backward && (a.op == Op::backward_input || a.op == Op::backward_weight));
      if (bad_kind) {
        return fail(Rule::backward_kind, r, a);
      }
      auto& count = a.op == Op::forward          ? forwards[index(a.stage, a.microbatch)]
                    : a.op == Op::backward       ? fulls[index(a.stage, a.microbatch)]
                    : a.op == Op::backward_input ? inputs[index(a.stage, a.microbatch)]
                                                 : weights[index(a.stage, a.microbatch)];
      if (++count > 1) {
        return fail(Rule::duplicate, r, a);
      }
    }
  }
  // missing
  for (int s = 0; s < stages; ++s) {
    for (int mb = 0; mb < m; ++mb) {
      const auto k = index(s, mb);
      const int owner = stage_rank(program.placement, pp, s);
      const auto compute = [&](Op op) {
        return Action{.op = op, .stage = s, .microbatch = mb, .peer = -1};
      };
      if (forwards[k] == 0) {
        return fail(Rule::missing, owner, compute(Op::forward));
      }
      if (!program.forward_only) {
        if (!program.split_backward && fulls[k] == 0) {
          return fail(Rule::missing, owner, compute(Op::backward));
        }
        if (program.split_backward && inputs[k] == 0) {
          return fail(Rule::missing, owner, compute(Op::backward_input));
        }
        if (program.split_backward && weights[k] == 0) {
          return fail(Rule::missing, owner, compute(Op::backward_weight));
        }
      }
    }
  }
  // order within a stage
  for (int r = 0; r < pp; ++r) {
    std::vector<char> f(static_cast<std::size_t>(stages * m), false);
    std::vector<char> i(static_cast<std::size_t>(stages * m), false);
    for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
      if (!a.is_compute()) {
        continue;
      }
      const auto k = index(a.stage, a.microbatch);
      if ((a.op == Op::backward || a.op == Op::backward_input) && !f[k]) {
        return fail(Rule::order, r, a);
      }
      if (a.op == Op::backward_weight && !i[k]) {
        return fail(Rule::order, r, a);
      }
      f[k] = f[k] || a.op == Op::forward;
      i[k] = i[k] || a.op == Op::backward_input;
    }
  }
  // unmatched communication
  if (has_comm) {
    for (int r = 0; r < pp; ++r) {
      for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
        if (a.op != Op::recv_activation && a.op != Op::recv_gradient) {
          continue;
        }
        const auto send = detail::matching_send(a, r);
        const bool peer_ok = a.peer >= 0 && a.peer < pp && send.stage >= 0 && send.stage < stages &&
                             stage_rank(program.placement, pp, send.stage) == a.peer;
        const auto& theirs = peer_ok ? program.ranks[static_cast<std::size_t>(a.peer)]
                                     : program.ranks[static_cast<std::size_t>(r)];
        if (!peer_ok || std::count(theirs.begin(), theirs.end(), send) != 1) {
          return fail(Rule::unmatched, r, a);
        }
      }
      for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
        if (a.op != Op::send_activation && a.op != Op::send_gradient) {
          continue;
        }
        const int to_stage = a.op == Op::send_activation ? a.stage + 1 : a.stage - 1;
        const Action recv{
            .op = a.op == Op::send_activation ? Op::recv_activation : Op::recv_gradient,
            .stage = a.op == Op::send_activation ? a.stage + 1 : a.stage - 1,
            .microbatch = a.microbatch,
            .peer = r};
        const bool peer_ok = a.peer >= 0 && a.peer < pp && to_stage >= 0 && to_stage < stages &&
                             stage_rank(program.placement, pp, to_stage) == a.peer;
        if (!peer_ok) {
          return fail(Rule::unmatched, r, a);
        }
        const auto& theirs = program.ranks[static_cast<std::size_t>(a.peer)];
        if (std::count(theirs.begin(), theirs.end(), recv) != 1) {
          return fail(Rule::unmatched, r, a);
        }
      }
    }
  }
  // deadlock: run the programs; a compute step needs its inputs (received, or computed earlier on
  // this rank; without communication actions a remote input counts once its producer ran).
  std::vector<char> f_done(static_cast<std::size_t>(stages * m), false);
  std::vector<char> b_done(static_cast<std::size_t>(stages * m), false);  // B or I
  std::vector<char> recv_a(static_cast<std::size_t>(stages * m), false);  // input of stage s
  std::vector<char> recv_g(static_cast<std::size_t>(stages * m), false);  // grad of stage s output
  std::vector<char> sent_a(static_cast<std::size_t>(stages * m), false);  // output of stage s
  std::vector<char> sent_g(static_cast<std::size_t>(stages * m), false);  // input grad of stage s
  std::vector<std::size_t> pc(static_cast<std::size_t>(pp), 0);
  std::vector<int> live(static_cast<std::size_t>(pp), 0);
  std::vector<int> peak(static_cast<std::size_t>(pp), 0);
  const auto rank_of = [&](int stage) { return stage_rank(program.placement, pp, stage); };
  const auto can_run = [&](int r, const Action& a) {
    const auto k = index(a.stage, a.microbatch);
    switch (a.op) {
      case Op::forward:
        if (a.stage == 0) {
          return true;
        }
        if (rank_of(a.stage - 1) == r || !has_comm) {
          return static_cast<bool>(f_done[index(a.stage - 1, a.microbatch)]);
        }
        return static_cast<bool>(recv_a[k]);
      case Op::backward:
      case Op::backward_input:
        if (a.stage == stages - 1) {
          return true;
        }
        if (rank_of(a.stage + 1) == r || !has_comm) {
          return static_cast<bool>(b_done[index(a.stage + 1, a.microbatch)]);
        }
        return static_cast<bool>(recv_g[k]);
      case Op::backward_weight:
        return true;
      case Op::send_activation:
        return static_cast<bool>(f_done[k]);
      case Op::send_gradient:
        return static_cast<bool>(b_done[k]);
      case Op::recv_activation:
        return static_cast<bool>(sent_a[index(a.stage - 1, a.microbatch)]);
      case Op::recv_gradient:
        return static_cast<bool>(sent_g[index(a.stage + 1, a.microbatch)]);
    }
    return false;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      const auto& actions = program.ranks[rr];
      while (pc[rr] < actions.size() && can_run(r, actions[pc[rr]])) {
        const auto& a = actions[pc[rr]];
        const auto k = index(a.stage, a.microbatch);
        switch (a.op) {
          case Op::forward:
            f_done[k] = true;
            peak[rr] = std::max(peak[rr], ++live[rr]);
            break;
          case Op::backward:
          case Op::backward_input:
            b_done[k] = true;
            --live[rr];
            break;
          case Op::backward_weight:
            break;
          case Op::send_activation:
            sent_a[k] = true;
            break;
          case Op::send_gradient:
            sent_g[k] = true;
            break;
          case Op::recv_activation:
            recv_a[k] = true;
            break;
          case Op::recv_gradient:
            recv_g[k] = true;
            break;
        }
        ++pc[rr];
        progress = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    if (pc[rr] < program.ranks[rr].size()) {
      return fail(Rule::deadlock, r, program.ranks[rr][pc[rr]]);
    }
  }
  return Verdict{.rule = Rule::none, .rank = -1, .action = {}, .peak_activations = peak};
}

/// Relative costs of compute actions (communication is free in this model).
struct Costs {
  double forward = 1.0;
  double backward_input = 1.0;   ///< I; a full B costs I + W
  double backward_weight = 1.0;  ///< W
};

/// When each compute action of a program ran.
struct Timeline {
  struct Slot {
    Action action;
    double start = 0;
    double end = 0;
  };
  std::vector<std::vector<Slot>> ranks;  ///< compute actions per rank, in program order
  double makespan = 0;

  /// Idle share of pp x makespan.
  [[nodiscard]] constexpr double bubble_fraction() const {
    double busy = 0;
    for (const auto& rank : ranks) {
      for (const auto& slot : rank) {
        busy += slot.end - slot.start;
      }
    }
    const double total = makespan * static_cast<double>(ranks.size());
    return total > 0 ? 1.0 - busy / total : 0.0;
  }
};

/// Runs a verified program under `costs`: each rank in its program order, a compute step starting
/// when the rank is free and its inputs exist (communication takes no time).
constexpr Timeline simulate(const Program& program, const Costs& costs) {
  const int pp = program.pp;
  const int stages = program.stages();
  const int m = program.microbatches;
  const auto index = [&](int stage, int mb) { return static_cast<std::size_t>(stage * m + mb); };
  constexpr double kNever = -1.0;
  std::vector<double> f_end(static_cast<std::size_t>(stages * m), kNever);
  std::vector<double> b_end(static_cast<std::size_t>(stages * m), kNever);  // B or I
  std::vector<double> free_at(static_cast<std::size_t>(pp), 0.0);
  std::vector<std::size_t> pc(static_cast<std::size_t>(pp), 0);
  Timeline timeline;
  timeline.ranks.resize(static_cast<std::size_t>(pp));
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      const auto& actions = program.ranks[rr];
      while (pc[rr] < actions.size()) {
        const auto& a = actions[pc[rr]];
        if (!a.is_compute()) {
          ++pc[rr];
          continue;
        }
        double ready = free_at[rr];
        double cost = costs.forward;
        if (a.op == Op::forward && a.stage > 0) {
          const double dep = f_end[index(a.stage - 1, a.microbatch)];
          if (dep == kNever) {
            break;
          }
          ready = std::max(ready, dep);
        }
        if (a.op == Op::backward || a.op == Op::backward_input) {
          cost = a.op == Op::backward ? costs.backward_input + costs.backward_weight
                                      : costs.backward_input;
          if (a.stage < stages - 1) {
            const double dep = b_end[index(a.stage + 1, a.microbatch)];
            if (dep == kNever) {
              break;
            }
            ready = std::max(ready, dep);
          }
        }
        if (a.op == Op::backward_weight) {
          cost = costs.backward_weight;
        }
        const double end = ready + cost;
        if (a.op == Op::forward) {
          f_end[index(a.stage, a.microbatch)] = end;
        } else if (a.op != Op::backward_weight) {
          b_end[index(a.stage, a.microbatch)] = end;
        }
        timeline.ranks[rr].push_back({.action = a, .start = ready, .end = end});
        free_at[rr] = end;
        timeline.makespan = std::max(timeline.makespan, end);
        ++pc[rr];
        progress = true;
      }
    }
  }
  return timeline;
}

}  // namespace d9d::pipeline
