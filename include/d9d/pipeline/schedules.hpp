// d9d/pipeline/schedules.hpp — pipeline schedules as policies of the Plan's pipeline slot.
//
//   using MyPlan = d9d::Plan<d9d::mesh<d9d::pp<4>, d9d::dp_shard<2>>,
//                            d9d::pipeline::ZeroBubbleH1<d9d::pipeline::microbatches<8>>>;
//   auto program = d9d::pipeline::static_program<MyPlan::pipeline, 4>();  // verified when compiled
//   auto p = d9d::pipeline::build_program<MyPlan::pipeline>(pp, m);    // dynamic sizes, verified
//
// A schedule policy (d9d::pipeline_schedule) fills d9d::slot::pipeline, names its stages per
// rank, its microbatch count (a number or d9d::dynamic) and a constexpr `build(pp, microbatches)`
// returning a compute-only Program. static_program<S, PP>() builds it when the sizes are static
// and verifies it — with communication inserted — at compile time: a broken schedule fails to
// compile naming the rule, the rank and the action (d9d::pipeline::schedule_violation<...>).
// build_program<S>(pp, m) does the same at start-up and throws std::invalid_argument.
#pragma once

#include <concepts>
#include <stdexcept>
#include <string>

#include <d9d/pipeline/builders.hpp>
#include <d9d/pipeline/policies.hpp>
#include <d9d/pipeline/verify.hpp>
#include <d9d/plan/degrees.hpp>
#include <d9d/plan/slots.hpp>

namespace d9d::pipeline {

/// Microbatches per step: a number, or d9d::dynamic (from the config).
template <int N>
struct microbatches {
  static_assert(N == dynamic || N >= 1,
                "d9d::pipeline::microbatches<N>: N must be >= 1 or d9d::dynamic");
  static constexpr int value = N;
};

/// Stages per rank of the looped and interleaved schedules.
template <int N>
struct stages_per_rank {
  static_assert(N >= 1, "d9d::pipeline::stages_per_rank<N>: N must be >= 1");
  static constexpr int value = N;
};

/// A schedule policy: opts into the pipeline slot and builds programs.
template <class S>
concept pipeline_schedule =
    plan_policy<S> && std::same_as<typename S::d9d_slot, slot::pipeline> && requires {
  { S::stages_per_rank } -> std::convertible_to<int>;
  { S::microbatches } -> std::convertible_to<int>;
  { S::build(1, 1) } -> std::same_as<Program>;
};

/// Forward only (inference), breadth-first.
template <class M = microbatches<dynamic>>
struct Inference {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 1;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return inference(pp, m); }
};

/// GPipe: all forwards, then all backwards.
template <class M = microbatches<dynamic>>
struct GPipe {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 1;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return gpipe(pp, m); }
};

/// GPipe over V stages per rank (round robin), breadth-first.
template <class V, class M = microbatches<dynamic>>
struct LoopedBfs {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = V::value;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return looped_bfs(pp, V::value, m); }
};

/// 1F1B: warm-up, one forward / one backward, cool-down. Needs microbatches >= pp.
template <class M = microbatches<dynamic>>
struct OneFOneB {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 1;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) {
    if (m < pp) {
      throw std::invalid_argument(
          "d9d::pipeline::OneFOneB: needs microbatches >= the pipeline degree (got " +
          std::to_string(m) + " < " + std::to_string(pp) + "). Fix: more microbatches, or GPipe");
    }
    return one_f_one_b(pp, m);
  }
  template <int PP>
  static constexpr bool check() {
    static_assert(M::value == dynamic || M::value >= PP,
                  "d9d::pipeline::OneFOneB: needs microbatches >= the pipeline degree (both are "
                  "the arguments shown with this error). Fix: raise d9d::pipeline::microbatches<N> "
                  "to at least pp, or use d9d::pipeline::GPipe");
    return true;
  }
};

/// Interleaved 1F1B over V stages per rank. Needs microbatches to be a multiple of pp.
template <class V, class M = microbatches<dynamic>>
struct Interleaved1F1B {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = V::value;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return interleaved_1f1b(pp, V::value, m); }
  template <int PP>
  static constexpr bool check() {
    static_assert(M::value == dynamic || V::value == 1 || M::value % PP == 0,
                  "d9d::pipeline::Interleaved1F1B: with several stages per rank the microbatches "
                  "must be a multiple of the pipeline degree. Fix: choose "
                  "d9d::pipeline::microbatches<N> with N % pp == 0");
    return true;
  }
};

/// ZB-H1 (ZB1P): 1F1B with split backward, weight gradients filling the bubbles.
template <class M = microbatches<dynamic>>
struct ZeroBubbleH1 {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 1;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return zero_bubble_h1(pp, m); }
};

/// ZBV: two V-placed stages per rank, split backward. `V` must be stages_per_rank<2>.
template <class M = microbatches<dynamic>, class V = stages_per_rank<2>>
struct ZeroBubbleV {
  static_assert(V::value == 2,
                "d9d::pipeline::ZeroBubbleV: the V schedule places exactly 2 stages on each rank. "
                "Fix: use d9d::pipeline::stages_per_rank<2> (the default), or "
                "d9d::pipeline::Interleaved1F1B for other counts");
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 2;
  static constexpr int microbatches = M::value;
  static constexpr Program build(int pp, int m) { return zero_bubble_v(pp, m); }
};

/// DualPipeV: DeepSeek's DualPipe on two V-placed stages per rank, split backward, forward and
/// backward of the two chunks paired in the steady state. Needs microbatches >= 2 x pp.
template <class M = microbatches<dynamic>>
struct DualPipeV {
  using d9d_slot = slot::pipeline;
  static constexpr int stages_per_rank = 2;
  static constexpr int microbatches = M::value;
  static constexpr Placement placement = Placement::v;
  static constexpr bool split_backward = true;
  static constexpr Program build(int pp, int m) {
    if (m < 2 * pp) {
      throw std::invalid_argument(
          "d9d::pipeline::DualPipeV: needs microbatches >= 2 x the pipeline degree (got " +
          std::to_string(m) + " < 2 x " + std::to_string(pp) + "). Fix: at least " +
          std::to_string(2 * pp) + " microbatches, or ZeroBubbleV");
    }
    return dual_pipe_v(pp, m);
  }
  template <int PP>
  static constexpr bool check() {
    static_assert(M::value == dynamic || M::value >= 2 * PP,
                  "d9d::pipeline::DualPipeV: needs microbatches >= 2 x the pipeline degree (both "
                  "are the arguments shown with this error). Fix: raise "
                  "d9d::pipeline::microbatches<N> to at least 2 * pp, or use "
                  "d9d::pipeline::ZeroBubbleV");
    return true;
  }
};

/// The first violation of a verified program, without the vectors (usable as a constant).
struct Violation {
  Rule rule = Rule::none;
  int rank = -1;
  Action action{};
};

/// "deadlock", "order", ...
[[nodiscard]] constexpr const char* to_string(Rule rule) {
  switch (rule) {
    case Rule::none:
      return "none";
    case Rule::wrong_rank:
      return "wrong_rank (an action for a stage of another rank)";
    case Rule::missing:
      return "missing (a microbatch's F, B, I or W never runs)";
    case Rule::duplicate:
      return "duplicate (an action runs twice)";
    case Rule::backward_kind:
      return "backward_kind (B in a split program, I/W in an unsplit one, backward in inference)";
    case Rule::order:
      return "order (a stage's I/B before its F, or W before its I)";
    case Rule::unmatched:
      return "unmatched (a send without its receive or a receive without its send)";
    case Rule::fifo:
      return "fifo (a receive posted out of the order its peer sends in; NCCL matches by order)";
    case Rule::deadlock:
      return "deadlock (the ranks wait for each other; each run of sends and receives is one batch "
             "that completes only when every peer has posted the matching operations)";
  }
  return "unknown";
}

/// Compile-time report: instantiated with a violation, it fails naming it in its arguments.
template <Rule R, int Rank, Op O, int Stage, int Microbatch>
struct schedule_violation {
  static_assert(R == Rule::none,
                "d9d::pipeline: the schedule's program breaks a rule; the rule, the rank and the "
                "action (op, stage, microbatch) are the arguments of "
                "d9d::pipeline::schedule_violation<...> in this error");
  static constexpr bool ok = R == Rule::none;
};

namespace detail {

template <pipeline_schedule S>
constexpr void check_sizes(int pp, int m) {
  if (S::microbatches != dynamic && S::microbatches != m) {
    throw std::invalid_argument("d9d::pipeline: the schedule fixes " +
                                std::to_string(S::microbatches) + " microbatches, the run asks " +
                                std::to_string(m));
  }
  (void)pp;
}

template <pipeline_schedule S>
constexpr Violation first_violation(int pp, int m) {
  const auto verdict = verify(with_communication(S::build(pp, m)));
  return {.rule = verdict.rule, .rank = verdict.rank, .action = verdict.action};
}

}  // namespace detail

/// Rules of specific schedules that the compiler can check from the types alone (a schedule may
/// declare them in `template <int PP> static constexpr bool check()`).
template <pipeline_schedule S, int PP>
constexpr bool check_static_schedule() {
  static_assert(PP >= 1, "d9d::pipeline: the pipeline degree must be >= 1");
  if constexpr (requires { S::template check<PP>(); }) {
    return S::template check<PP>();
  }
  return true;
}

/// The program of a schedule whose microbatch count is static, for PP ranks, verified by the
/// compiler (the Program itself holds vectors, so it is built when called).
template <pipeline_schedule S, int PP>
constexpr Program static_program() {
  static_assert(S::microbatches != dynamic,
                "d9d::pipeline::static_program: the schedule's microbatches are d9d::dynamic. "
                "Fix: call d9d::pipeline::build_program<S>(pp, microbatches) at start-up");
  if constexpr (check_static_schedule<S, PP>()) {
    constexpr Violation v = detail::first_violation<S>(PP, S::microbatches);
    static_assert(
        schedule_violation<v.rule, v.rank, v.action.op, v.action.stage, v.action.microbatch>::ok);
  }
  return with_communication(S::build(PP, S::microbatches));
}

/// The verified program for run-time sizes; std::invalid_argument naming the rule and the action.
template <pipeline_schedule S>
Program build_program(int pp, int microbatches) {
  detail::check_sizes<S>(pp, microbatches);
  auto program = with_communication(S::build(pp, microbatches));
  const auto verdict = verify(program);
  if (!verdict.ok()) {
    throw std::invalid_argument(
        std::string("d9d::pipeline: the schedule breaks rule ") + to_string(verdict.rule) +
        " on rank " + std::to_string(verdict.rank) + " at action " + to_string(verdict.action));
  }
  return program;
}

}  // namespace d9d::pipeline
