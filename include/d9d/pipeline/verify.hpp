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
#include <stdexcept>
#include <string>
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
/// The receive that takes `send` (posted by rank `sender`) on its peer: an activation enters the
/// next stage, an input gradient the previous one.
constexpr Action matching_recv(const Action& send, int sender) {
  const bool activation = send.op == Op::send_activation;
  return {.op = activation ? Op::recv_activation : Op::recv_gradient,
          .stage = activation ? send.stage + 1 : send.stage - 1,
          .microbatch = send.microbatch,
          .peer = sender};
}
constexpr Action recv_of(const Action& a, int from) { return matching_recv(send_of(a, -1), from); }

/// The send that feeds `recv` (posted by rank `receiver`): the activation of stage s comes from
/// stage s - 1, the gradient received by stage s from stage s + 1.
constexpr Action matching_send(const Action& recv, int receiver) {
  const bool activation = recv.op == Op::recv_activation;
  return {.op = activation ? Op::send_activation : Op::send_gradient,
          .stage = activation ? recv.stage - 1 : recv.stage + 1,
          .microbatch = recv.microbatch,
          .peer = receiver};
}

constexpr bool is_backward(Op op) {
  return op == Op::backward || op == Op::backward_input || op == Op::backward_weight;
}

/// Whether compute step `a` consumes another stage's output: a forward past the first stage (the
/// previous stage's activation), a B or I before the last stage (the next stage's input gradient).
constexpr bool needs_input(const Action& a, int stages) {
  return (a.op == Op::forward && a.stage > 0) ||
         ((a.op == Op::backward || a.op == Op::backward_input) && a.stage < stages - 1);
}
/// The stage whose output `a` consumes (needs_input(a) holds).
constexpr int producer_stage(const Action& a) {
  return a.op == Op::forward ? a.stage - 1 : a.stage + 1;
}

/// A value per (stage, microbatch) for the two compute steps other stages consume: the forward
/// and the input-gradient step (B or I). The one model of data dependencies that
/// with_communication (rounds), verify (done flags) and simulate (end times) share.
template <class T>
class StepTable {
 public:
  constexpr StepTable(int stages, int microbatches, T unset)
      : microbatches_(microbatches),
        unset_(unset),
        forward_(static_cast<std::size_t>(stages * microbatches), unset),
        input_gradient_(static_cast<std::size_t>(stages * microbatches), unset) {}

  /// Records `value` for compute step `a` (a W records nothing: no other stage consumes it).
  constexpr void record(const Action& a, T value) {
    if (a.op == Op::forward) {
      forward_[index(a.stage, a.microbatch)] = value;
    } else if (a.op == Op::backward || a.op == Op::backward_input) {
      input_gradient_[index(a.stage, a.microbatch)] = value;
    }
  }
  /// The value of the step whose output `a` consumes (needs_input(a) holds); unset() if none yet.
  [[nodiscard]] constexpr T input_of(const Action& a) const {
    return a.op == Op::forward ? forward_[index(a.stage - 1, a.microbatch)]
                               : input_gradient_[index(a.stage + 1, a.microbatch)];
  }
  /// The value of the step that produces `a`'s data: `a` itself for an F, B or I; the sent step
  /// for a send.
  [[nodiscard]] constexpr T output_of(const Action& a) const {
    const bool activation = a.op == Op::forward || a.op == Op::send_activation;
    return (activation ? forward_ : input_gradient_)[index(a.stage, a.microbatch)];
  }
  [[nodiscard]] constexpr T unset() const { return unset_; }

 private:
  [[nodiscard]] constexpr std::size_t index(int stage, int microbatch) const {
    return static_cast<std::size_t>(stage * microbatches_ + microbatch);
  }
  int microbatches_;
  T unset_;
  std::vector<T> forward_;
  std::vector<T> input_gradient_;
};

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
  const auto valid = [&](const Action& a) {
    return a.stage >= 0 && a.stage < stages && a.microbatch >= 0 && a.microbatch < m;
  };
  constexpr int kNever = -1;
  detail::StepTable<int> rounds(stages, m, kNever);  // when each F and I/B ran
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
  // A step is ready in round t when the step it needs ran in an earlier round.
  const auto ready = [&](const Action& a, int t) {
    if (!valid(a)) {
      return false;
    }
    if (!detail::needs_input(a, stages)) {
      return true;
    }
    const int dep = rounds.input_of(a);
    return dep != kNever && dep < t;
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
      rounds.record(a, t);
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
      const bool compute = a.is_compute() && valid(a);
      if (compute && detail::needs_input(a, stages)) {
        const Action producer{.op = a.op == Op::forward ? Op::forward : Op::backward_input,
                              .stage = detail::producer_stage(a),
                              .microbatch = a.microbatch,
                              .peer = -1};
        const int from = stage_rank(out.placement, pp, producer.stage);
        if (from != r && rounds.input_of(a) == kNever) {
          out.ranks[rr].push_back(detail::recv_of(producer, from));
        }
      }
      out.ranks[rr].push_back(a);
      if (compute) {
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

constexpr Verdict violation(Rule rule, int rank, const Action& action) {
  return Verdict{.rule = rule, .rank = rank, .action = action, .peak_activations = {}};
}

/// How often each compute step of each (stage, microbatch) occurs (the `missing` pass reads it).
struct ComputeCounts {
  int microbatches;
  std::vector<int> forwards, fulls, inputs, weights;

  constexpr explicit ComputeCounts(const Program& program)
      : microbatches(program.microbatches),
        forwards(static_cast<std::size_t>(program.stages() * program.microbatches), 0),
        fulls(forwards.size(), 0),
        inputs(forwards.size(), 0),
        weights(forwards.size(), 0) {}
  [[nodiscard]] constexpr std::size_t index(int stage, int microbatch) const {
    return static_cast<std::size_t>(stage * microbatches + microbatch);
  }
  constexpr int& of(const Action& a) {
    const auto k = index(a.stage, a.microbatch);
    return a.op == Op::forward          ? forwards[k]
           : a.op == Op::backward       ? fulls[k]
           : a.op == Op::backward_input ? inputs[k]
                                        : weights[k];
  }
};

/// wrong_rank, backward_kind and duplicate, counting the compute steps into `counts`.
constexpr Verdict check_actions(const Program& program, ComputeCounts& counts) {
  const int pp = program.pp;
  const int stages = program.stages();
  for (int r = 0; r < pp; ++r) {
    for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
      if (a.stage < 0 || a.stage >= stages || a.microbatch < 0 ||
          a.microbatch >= program.microbatches || stage_rank(program.placement, pp, a.stage) != r) {
        return violation(Rule::wrong_rank, r, a);
      }
      if (!a.is_compute()) {
        continue;
      }
      const bool bad_kind =
          (program.forward_only && is_backward(a.op)) ||
          (program.split_backward && a.op == Op::backward) ||
          (!program.split_backward && (a.op == Op::backward_input || a.op == Op::backward_weight));
      if (bad_kind) {
        return violation(Rule::backward_kind, r, a);
      }
      if (++counts.of(a) > 1) {
        return violation(Rule::duplicate, r, a);
      }
    }
  }
  return {};
}

/// missing: every (stage, microbatch) has its F and its B (or its I and W) somewhere.
constexpr Verdict check_missing(const Program& program, const ComputeCounts& counts) {
  for (int s = 0; s < program.stages(); ++s) {
    for (int mb = 0; mb < program.microbatches; ++mb) {
      const auto k = counts.index(s, mb);
      const int owner = stage_rank(program.placement, program.pp, s);
      const auto missing = [&](Op op) {
        return violation(Rule::missing, owner,
                         Action{.op = op, .stage = s, .microbatch = mb, .peer = -1});
      };
      if (counts.forwards[k] == 0) {
        return missing(Op::forward);
      }
      if (program.forward_only) {
        continue;
      }
      if (!program.split_backward && counts.fulls[k] == 0) {
        return missing(Op::backward);
      }
      if (program.split_backward && counts.inputs[k] == 0) {
        return missing(Op::backward_input);
      }
      if (program.split_backward && counts.weights[k] == 0) {
        return missing(Op::backward_weight);
      }
    }
  }
  return {};
}

/// order: on a stage, F before its I or B, I before its W.
constexpr Verdict check_order(const Program& program) {
  for (int r = 0; r < program.pp; ++r) {
    StepTable<char> done(program.stages(), program.microbatches, false);
    for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
      if (!a.is_compute()) {
        continue;
      }
      const auto ran = [&](Op op) {
        return done.output_of({.op = op, .stage = a.stage, .microbatch = a.microbatch, .peer = -1});
      };
      if ((a.op == Op::backward || a.op == Op::backward_input) && ran(Op::forward) == 0) {
        return violation(Rule::order, r, a);
      }
      // A W follows its I (a full B with a W is a backward_kind violation already).
      if (a.op == Op::backward_weight && ran(Op::backward_input) == 0) {
        return violation(Rule::order, r, a);
      }
      done.record(a, true);
    }
  }
  return {};
}

/// Whether `peer` is a rank and holds `stage`.
constexpr bool holds(const Program& program, int peer, int stage) {
  return peer >= 0 && peer < program.pp && stage >= 0 && stage < program.stages() &&
         stage_rank(program.placement, program.pp, stage) == peer;
}

/// unmatched: every receive has exactly one send on its peer, and every send one receive (each
/// rank's receives first, then its sends).
constexpr Verdict check_matched(const Program& program) {
  for (int r = 0; r < program.pp; ++r) {
    for (const bool receives : {true, false}) {
      for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
        const bool recv = a.op == Op::recv_activation || a.op == Op::recv_gradient;
        const bool send = a.op == Op::send_activation || a.op == Op::send_gradient;
        if (receives ? !recv : !send) {
          continue;
        }
        const Action other = recv ? matching_send(a, r) : matching_recv(a, r);
        if (!holds(program, a.peer, other.stage)) {
          return violation(Rule::unmatched, r, a);
        }
        const auto& theirs = program.ranks[static_cast<std::size_t>(a.peer)];
        if (std::count(theirs.begin(), theirs.end(), other) != 1) {
          return violation(Rule::unmatched, r, a);
        }
      }
    }
  }
  return {};
}

/// fifo: NCCL matches the messages between two ranks in the order they are posted, not by tag,
/// so the k-th receive on b from a must be the k-th send on a to b.
constexpr Verdict check_fifo(const Program& program) {
  const int pp = program.pp;
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
      if (k >= stream.size() || stream[k] != matching_send(a, r)) {
        return violation(Rule::fifo, r, a);
      }
    }
  }
  return {};
}

/// deadlock: runs the programs. A compute step waits for its input (received, or computed earlier
/// on this rank; without communication actions a remote input counts once its producer ran). Each
/// maximal run of consecutive communication actions is posted as one batch (an NCCL group) and
/// the rank waits until all of it completed, sends included. A send and its receive complete
/// together (rendezvous), once both sit in the batches their ranks have posted and the sent data
/// exists; the operations of a batch may complete at different moments. Also counts live
/// activations (forwards whose I or B has not run) per rank.
class ProgramRun {
 public:
  constexpr ProgramRun(const Program& program, bool has_comm)
      : program_(program),
        has_comm_(has_comm),
        done_(program.stages(), program.microbatches, false),
        arrived_(program.stages(), program.microbatches, false),
        comm_done_(static_cast<std::size_t>(program.pp)),
        pc_(static_cast<std::size_t>(program.pp), 0),
        live_(static_cast<std::size_t>(program.pp), 0),
        peak_(static_cast<std::size_t>(program.pp), 0) {
    for (std::size_t r = 0; r < comm_done_.size(); ++r) {
      comm_done_[r].resize(program.ranks[r].size(), false);
    }
  }

  /// Steps every rank until none can go on; the first step or open operation a rank stopped at.
  constexpr Verdict run() {
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < program_.pp; ++r) {
        progress = compute(r) || progress;
        progress = communicate(r) || progress;
      }
    }
    for (int r = 0; r < program_.pp; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      const auto& actions = program_.ranks[rr];
      for (std::size_t j = pc_[rr]; j < actions.size(); ++j) {
        if (actions[j].is_compute() ? j == pc_[rr] : !comm_done_[rr][j]) {
          return violation(Rule::deadlock, r, actions[j]);  // the step, or the batch's first op
        }
      }
    }
    return Verdict{.rule = Rule::none, .rank = -1, .action = {}, .peak_activations = peak_};
  }

 private:
  [[nodiscard]] constexpr bool can_run(int r, const Action& a) const {
    if (!needs_input(a, program_.stages())) {
      return true;
    }
    const bool local = stage_rank(program_.placement, program_.pp, producer_stage(a)) == r;
    if (local || !has_comm_) {
      return done_.input_of(a) != 0;
    }
    // The receive stored what arrived for stage `a.stage` under the producing step's entry.
    return arrived_.input_of(a) != 0;
  }

  // Runs rank r's compute steps while their inputs exist.
  constexpr bool compute(int r) {
    const auto rr = static_cast<std::size_t>(r);
    const auto& actions = program_.ranks[rr];
    bool progress = false;
    while (pc_[rr] < actions.size() && actions[pc_[rr]].is_compute() &&
           can_run(r, actions[pc_[rr]])) {
      const auto& a = actions[pc_[rr]];
      done_.record(a, true);
      if (a.op == Op::forward) {
        peak_[rr] = std::max(peak_[rr], ++live_[rr]);
      } else if (a.op != Op::backward_weight) {
        --live_[rr];
      }
      ++pc_[rr];
      progress = true;
    }
    return progress;
  }

  // The end of the batch that starts at pc_[r] (pc_[r] itself when the rank is at a compute step).
  [[nodiscard]] constexpr std::size_t batch_end(int r) const {
    const auto& actions = program_.ranks[static_cast<std::size_t>(r)];
    std::size_t end = pc_[static_cast<std::size_t>(r)];
    while (end < actions.size() && !actions[end].is_compute()) {
      ++end;
    }
    return end;
  }

  // Completes the sends of rank r's posted batch whose receives the peer has posted; moves past
  // the batch once all of it completed.
  constexpr bool communicate(int r) {
    const auto rr = static_cast<std::size_t>(r);
    const auto& actions = program_.ranks[rr];
    const std::size_t end = batch_end(r);
    if (end == pc_[rr]) {
      return false;
    }
    bool progress = false;
    bool all_done = true;
    for (std::size_t j = pc_[rr]; j < end; ++j) {
      const auto& a = actions[j];
      const bool send = a.op == Op::send_activation || a.op == Op::send_gradient;
      if (!comm_done_[rr][j] && send && done_.output_of(a) != 0) {
        const auto q = static_cast<std::size_t>(a.peer);
        const Action recv = matching_recv(a, r);
        const std::size_t their_end = batch_end(a.peer);
        for (std::size_t i = pc_[q]; i < their_end; ++i) {
          if (!comm_done_[q][i] && program_.ranks[q][i] == recv) {
            comm_done_[q][i] = true;
            comm_done_[rr][j] = true;
            // What arrived is the sent step's output: recorded under the sending step.
            arrived_.record(
                Action{.op = a.op == Op::send_activation ? Op::forward : Op::backward_input,
                       .stage = a.stage,
                       .microbatch = a.microbatch,
                       .peer = -1},
                true);
            progress = true;
            break;
          }
        }
      }
      all_done = all_done && comm_done_[rr][j];
    }
    if (all_done) {
      pc_[rr] = end;
      progress = true;
    }
    return progress;
  }

  const Program& program_;
  bool has_comm_;
  StepTable<char> done_;     // F and I/B that ran
  StepTable<char> arrived_;  // outputs of F and I/B received by the consuming rank
  std::vector<std::vector<char>> comm_done_;
  std::vector<std::size_t> pc_;
  std::vector<int> live_;
  std::vector<int> peak_;
};

}  // namespace detail

/// Checks a program (with or without communication actions): the passes of the file comment, in
/// order; the first violation, or the peak activations of a valid program.
constexpr Verdict verify(const Program& program) {
  detail::ComputeCounts counts(program);
  if (auto v = detail::check_actions(program, counts); !v.ok()) {
    return v;
  }
  if (auto v = detail::check_missing(program, counts); !v.ok()) {
    return v;
  }
  if (auto v = detail::check_order(program); !v.ok()) {
    return v;
  }
  const bool has_comm = std::any_of(program.ranks.begin(), program.ranks.end(), [](const auto& r) {
    return std::any_of(r.begin(), r.end(), [](const Action& a) { return !a.is_compute(); });
  });
  if (has_comm) {
    if (auto v = detail::check_matched(program); !v.ok()) {
      return v;
    }
    if (auto v = detail::check_fifo(program); !v.ok()) {
      return v;
    }
  }
  return detail::ProgramRun(program, has_comm).run();
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

/// Runs a verified program with each stage's own costs (`stage_costs[s]` for stage s, one per
/// stage of the program): each rank in its program order, a compute step starting when the rank is
/// free and its inputs exist (communication takes no time). Uneven stages (a head heavier than a
/// layer, one rank's GPU slower) give the program's own bubble at those costs.
/// std::invalid_argument when the costs are not one per stage.
constexpr Timeline simulate_stages(const Program& program, const std::vector<Costs>& stage_costs) {
  const int pp = program.pp;
  const int stages = program.stages();
  if (stage_costs.size() != static_cast<std::size_t>(stages)) {
    throw std::invalid_argument(
        "d9d::pipeline::simulate_stages: " + std::to_string(stage_costs.size()) + " costs for " +
        std::to_string(stages) + " stages");
  }
  constexpr double kNever = -1.0;
  detail::StepTable<double> ends(stages, program.microbatches, kNever);  // when F and I/B ended
  const auto cost_of = [&](const Action& a) {
    const auto& costs = stage_costs[static_cast<std::size_t>(a.stage)];
    switch (a.op) {
      case Op::backward:
        return costs.backward_input + costs.backward_weight;
      case Op::backward_input:
        return costs.backward_input;
      case Op::backward_weight:
        return costs.backward_weight;
      default:
        return costs.forward;
    }
  };
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
      for (; pc[rr] < actions.size(); ++pc[rr]) {
        const auto& a = actions[pc[rr]];
        if (!a.is_compute()) {
          continue;
        }
        double ready = free_at[rr];
        if (detail::needs_input(a, stages)) {
          const double input = ends.input_of(a);
          if (input == kNever) {
            break;
          }
          ready = std::max(ready, input);
        }
        const double end = ready + cost_of(a);
        ends.record(a, end);
        timeline.ranks[rr].push_back({.action = a, .start = ready, .end = end});
        free_at[rr] = end;
        timeline.makespan = std::max(timeline.makespan, end);
        progress = true;
      }
    }
  }
  return timeline;
}

/// Runs a verified program under `costs`, the same for every stage (simulate_stages).
constexpr Timeline simulate(const Program& program, const Costs& costs) {
  return simulate_stages(program,
                         std::vector<Costs>(static_cast<std::size_t>(program.stages()), costs));
}

}  // namespace d9d::pipeline
