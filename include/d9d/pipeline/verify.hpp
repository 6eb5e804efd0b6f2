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
//   fifo             the receives on b from a are not in the order a sends to b (NCCL matches
//                    point-to-point messages between two ranks by posting order, not by tag)
//   deadlock         executing the programs stops. The executor posts each maximal run of
//                    consecutive sends and receives as one batch (an NCCL group) and waits for
//                    all of it, sends included; a send and its receive complete together once
//                    both are posted (rendezvous). A compute step waits for its inputs: received,
//                    or computed earlier on its own rank. (No deadlock here implies none with
//                    non-blocking sends either.)
// and measures the peak number of live activations (forwards whose I/B has not run) per rank.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <d9d/pipeline/program.hpp>

namespace d9d::pipeline {

namespace detail {

/// The rank that needs the output of compute step `a` on rank `r`, or -1 (none, or `r` itself):
/// a forward's activation goes to the next stage, an I's or B's input gradient to the previous.
constexpr int remote_consumer(const Program& program, int r, const Action& a) {
  const int pp = program.pp;
  int to = -1;
  if (a.op == Op::forward && a.stage < program.stages() - 1) {
    to = stage_rank(program.placement, pp, a.stage + 1);
  }
  if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage > 0) {
    to = stage_rank(program.placement, pp, a.stage - 1);
  }
  return to == r ? -1 : to;
}

/// The send of compute step `a`'s output to rank `to`, and the receive of it on `to` from `from`.
constexpr Action send_of(const Action& a, int to) {
  return {.op = a.op == Op::forward ? Op::send_activation : Op::send_gradient,
          .stage = a.stage,
          .microbatch = a.microbatch,
          .peer = to};
}
constexpr Action recv_of(const Action& a, int from) {
  const bool forward = a.op == Op::forward;
  return {.op = forward ? Op::recv_activation : Op::recv_gradient,
          .stage = forward ? a.stage + 1 : a.stage - 1,
          .microbatch = a.microbatch,
          .peer = from};
}

}  // namespace detail

/// Inserts the sends and receives the compute actions need. A send goes right after the compute
/// step that produces its data. Receives are placed for the executor, which posts each run of
/// consecutive sends and receives as one NCCL group and waits for all of it: a send only completes
/// once its receive is posted (rendezvous). Placing a receive right before the step that needs it
/// deadlocks then — in looped BFS rank 1 waits, in the group with its first send back to rank 0,
/// for rank 0 to post that receive, while rank 0 is still sending its stage-0 activations, each
/// waiting for rank 1 to post the next receive. So the ranks are stepped in rounds of one compute
/// step (unit time, communication free), and each message is received in the group that follows the
/// round in which its data is produced — on both ranks, the send in the sender's group and the
/// receive in the receiver's (a rank idle in a round merges that round's group with the one
/// before). The operations of round t only wait for each other, and every rank posts them once
/// the rounds before t completed, so the result cannot deadlock; and a rank sends at most one
/// message per round, so messages between two ranks are received in the order they are sent
/// (NCCL's FIFO). The price: where real costs differ from unit costs, a rank may wait in a group
/// for data it needs only later (the sender would otherwise wait for it).
/// Steps the rounds never reach (an invalid program) fall back to a receive right before the step.
/// Communication actions already in the input are kept in front of the compute step they preceded.
constexpr Program with_communication(const Program& compute_only) {
  Program out = compute_only;
  const int pp = out.pp;
  const int stages = out.stages();
  const int m = out.microbatches;
  const auto index = [&](int stage, int mb) { return static_cast<std::size_t>(stage * m + mb); };
  const auto valid = [&](const Action& a) {
    return a.stage >= 0 && a.stage < stages && a.microbatch >= 0 && a.microbatch < m;
  };
  constexpr int kNever = -1;
  std::vector<int> f_round(static_cast<std::size_t>(stages * m), kNever);  // when F ran
  std::vector<int> b_round(static_cast<std::size_t>(stages * m), kNever);  // when I or B ran
  std::vector<std::size_t> pc(static_cast<std::size_t>(pp), 0);
  for (int r = 0; r < pp; ++r) {
    out.ranks[static_cast<std::size_t>(r)].clear();
  }
  // Emits rank r's input actions up to and including its next compute step.
  const auto emit_next = [&](int r) {
    const auto rr = static_cast<std::size_t>(r);
    const auto& in = compute_only.ranks[rr];
    bool compute = false;
    while (pc[rr] < in.size() && !compute) {
      compute = in[pc[rr]].is_compute();
      out.ranks[rr].push_back(in[pc[rr]++]);
    }
  };
  const auto next_compute = [&](int r) -> const Action* {
    const auto& in = compute_only.ranks[static_cast<std::size_t>(r)];
    for (std::size_t i = pc[static_cast<std::size_t>(r)]; i < in.size(); ++i) {
      if (in[i].is_compute()) {
        return &in[i];
      }
    }
    return nullptr;
  };
  // A step is ready in round t when the steps it needs ran in earlier rounds.
  const auto ready = [&](const Action& a, int t) {
    if (!valid(a)) {
      return false;
    }
    if (a.op == Op::forward && a.stage > 0) {
      const int dep = f_round[index(a.stage - 1, a.microbatch)];
      return dep != kNever && dep < t;
    }
    if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage < stages - 1) {
      const int dep = b_round[index(a.stage + 1, a.microbatch)];
      return dep != kNever && dep < t;
    }
    return true;
  };
  std::vector<std::pair<int, Action>> produced;  // this round's (rank, step) with a remote consumer
  for (int t = 0;; ++t) {
    produced.clear();
    bool any = false;
    for (int r = 0; r < pp; ++r) {
      const Action* next = next_compute(r);
      if (next == nullptr || !ready(*next, t)) {
        continue;
      }
      const Action a = *next;
      emit_next(r);
      any = true;
      if (a.op == Op::forward) {
        f_round[index(a.stage, a.microbatch)] = t;
      } else if (a.op != Op::backward_weight) {
        b_round[index(a.stage, a.microbatch)] = t;
      }
      if (detail::remote_consumer(out, r, a) != -1) {
        produced.emplace_back(r, a);
      }
    }
    if (!any) {
      break;
    }
    for (const auto& [r, a] : produced) {
      const int to = detail::remote_consumer(out, r, a);
      out.ranks[static_cast<std::size_t>(r)].push_back(detail::send_of(a, to));
      out.ranks[static_cast<std::size_t>(to)].push_back(detail::recv_of(a, r));
    }
  }
  // Fallback for what the rounds did not reach: a receive right before the step that needs data
  // produced on another rank (unless the rounds already placed it), a send right after.
  for (int r = 0; r < pp; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    const auto& in = compute_only.ranks[rr];
    for (; pc[rr] < in.size(); ++pc[rr]) {
      const auto& a = in[pc[rr]];
      if (a.is_compute() && valid(a)) {
        const bool needs_activation = a.op == Op::forward && a.stage > 0;
        const bool needs_gradient =
            (a.op == Op::backward || a.op == Op::backward_input) && a.stage < stages - 1;
        if (needs_activation || needs_gradient) {
          const Action producer{.op = needs_activation ? Op::forward : Op::backward_input,
                                .stage = needs_activation ? a.stage - 1 : a.stage + 1,
                                .microbatch = a.microbatch,
                                .peer = -1};
          const int from = stage_rank(out.placement, pp, producer.stage);
          const int round = needs_activation ? f_round[index(producer.stage, a.microbatch)]
                                             : b_round[index(producer.stage, a.microbatch)];
          if (from != r && round == kNever) {
            out.ranks[rr].push_back(detail::recv_of(producer, from));
          }
        }
      }
      out.ranks[rr].push_back(a);
      if (a.is_compute() && valid(a)) {
        const int to = detail::remote_consumer(out, r, a);
        if (to != -1) {
          out.ranks[rr].push_back(detail::send_of(a, to));
        }
      }
    }
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
  fifo,
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
  // fifo: NCCL matches the messages between two ranks in the order they are posted, not by tag,
  // so the k-th receive on b from a must be the k-th send on a to b.
  if (has_comm) {
    std::vector<std::vector<Action>> sends(static_cast<std::size_t>(pp * pp));  // [from * pp + to]
    for (int r = 0; r < pp; ++r) {
      for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
        if (a.op == Op::send_activation || a.op == Op::send_gradient) {
          sends[static_cast<std::size_t>(r * pp + a.peer)].push_back(a);
        }
      }
    }
    for (int r = 0; r < pp; ++r) {
      std::vector<std::size_t> received(static_cast<std::size_t>(pp), 0);  // per sender
      for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
        if (a.op != Op::recv_activation && a.op != Op::recv_gradient) {
          continue;
        }
        const auto& stream = sends[static_cast<std::size_t>(a.peer * pp + r)];
        const std::size_t k = received[static_cast<std::size_t>(a.peer)]++;
        if (k >= stream.size() || stream[k] != detail::matching_send(a, r)) {
          return fail(Rule::fifo, r, a);
        }
      }
    }
  }
  // deadlock: run the programs. A compute step waits for its inputs (received, or computed earlier
  // on this rank; without communication actions a remote input counts once its producer ran). Each
  // maximal run of consecutive communication actions is posted as one batch (an NCCL group) and
  // the rank waits until all of it completed, sends included. A send and its receive complete
  // together (rendezvous), once both sit in the batches their ranks have posted and the sent data
  // exists; the operations of a batch may complete at different moments.
  std::vector<char> f_done(static_cast<std::size_t>(stages * m), false);
  std::vector<char> b_done(static_cast<std::size_t>(stages * m), false);  // B or I
  std::vector<char> recv_a(static_cast<std::size_t>(stages * m), false);  // input of stage s
  std::vector<char> recv_g(static_cast<std::size_t>(stages * m), false);  // grad of stage s output
  std::vector<std::vector<char>> comm_done(static_cast<std::size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    comm_done[static_cast<std::size_t>(r)].resize(program.ranks[static_cast<std::size_t>(r)].size(),
                                                  false);
  }
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
      default:  // W; communication is run batch by batch below
        return true;
    }
  };
  // The end of the batch that starts at pc[r] (pc[r] itself when the rank is at a compute step).
  const auto batch_end = [&](int r) {
    const auto& actions = program.ranks[static_cast<std::size_t>(r)];
    std::size_t end = pc[static_cast<std::size_t>(r)];
    while (end < actions.size() && !actions[end].is_compute()) {
      ++end;
    }
    return end;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      const auto& actions = program.ranks[rr];
      while (pc[rr] < actions.size() && actions[pc[rr]].is_compute() &&
             can_run(r, actions[pc[rr]])) {
        const auto& a = actions[pc[rr]];
        const auto k = index(a.stage, a.microbatch);
        if (a.op == Op::forward) {
          f_done[k] = true;
          peak[rr] = std::max(peak[rr], ++live[rr]);
        } else if (a.op != Op::backward_weight) {
          b_done[k] = true;
          --live[rr];
        }
        ++pc[rr];
        progress = true;
      }
      const std::size_t end = batch_end(r);
      if (end == pc[rr]) {
        continue;
      }
      // Complete the sends of this batch whose receives the peer has posted.
      bool all_done = true;
      for (std::size_t j = pc[rr]; j < end; ++j) {
        const auto& a = actions[j];
        const bool send = a.op == Op::send_activation || a.op == Op::send_gradient;
        const bool data = a.op == Op::send_activation ? f_done[index(a.stage, a.microbatch)]
                                                      : b_done[index(a.stage, a.microbatch)];
        if (!comm_done[rr][j] && send && data) {
          const auto q = static_cast<std::size_t>(a.peer);
          const Action recv{
              .op = a.op == Op::send_activation ? Op::recv_activation : Op::recv_gradient,
              .stage = a.op == Op::send_activation ? a.stage + 1 : a.stage - 1,
              .microbatch = a.microbatch,
              .peer = r};
          const std::size_t their_end = batch_end(a.peer);
          for (std::size_t i = pc[q]; i < their_end; ++i) {
            if (!comm_done[q][i] && program.ranks[q][i] == recv) {
              comm_done[q][i] = true;
              comm_done[rr][j] = true;
              auto& arrived = recv.op == Op::recv_activation ? recv_a : recv_g;
              arrived[index(recv.stage, recv.microbatch)] = true;
              progress = true;
              break;
            }
          }
        }
        all_done = all_done && comm_done[rr][j];
      }
      if (all_done) {
        pc[rr] = end;
        progress = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    const auto& actions = program.ranks[rr];
    for (std::size_t j = pc[rr]; j < actions.size(); ++j) {
      if (actions[j].is_compute() ? j == pc[rr] : !comm_done[rr][j]) {
        return fail(Rule::deadlock, r, actions[j]);  // the step, or the batch's first open op
      }
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
