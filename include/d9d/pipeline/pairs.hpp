// d9d/pipeline/pairs.hpp — a forward of one stage and a backward of another run at once (DualPipe's
// overlap): which actions pair, and a program whose pairs are grouped so that they can.
//
//   auto program = d9d::pipeline::group_pairs(
//       d9d::pipeline::with_communication(d9d::pipeline::dual_pipe_v(pp, m)));
//   static_assert(d9d::pipeline::verify(program).ok());   // with static sizes
//   for (std::size_t i = 0; i + 1 < actions.size(); ++i)
//     if (d9d::pipeline::pair_at(actions, i)) { ... }      // actions[i] and actions[i + 1]
//
// A pair is a forward F(s, a) directly followed by a backward I(t, b) or B(t, b) of another stage
// t != s on the same rank. Nothing flows between the two (the forward reads stage s's input, the
// backward stage t's saved graph and its output's gradient), so they may run concurrently
// (Executor with ExecutorOptions::overlap_pairs). with_communication() places a forward's sends
// right after it and a backward's receives right before it, so in DualPipeV's steady state
// (F0 B1 F1 B0) each forward's sends stand between it and the next backward. group_pairs() moves,
// for every forward followed by such a backward with only communication between them, the
// receives that backward takes to before the forward, and the rest of that communication (the
// forward's sends, other receives) to after the backward: [receives of I] F I [sends of F]. Every
// rank posts the same batches in a new order, so the result must verify() again (deadlock
// freedom, FIFO order per peer): DualPipeV's does for every size the tests try
// (tests/pipeline/schedule_test.cpp).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <d9d/pipeline/program.hpp>

namespace d9d::pipeline {

/// Whether actions[i] and actions[i + 1] are a pair: a forward, then a backward (B or I) of
/// another stage.
[[nodiscard]] constexpr bool pair_at(const std::vector<Action>& actions, std::size_t i) {
  if (i + 1 >= actions.size()) {
    return false;
  }
  const Action& f = actions[i];
  const Action& b = actions[i + 1];
  return f.op == Op::forward && (b.op == Op::backward || b.op == Op::backward_input) &&
         b.stage != f.stage;
}

/// `program` (with communication) with each forward and the backward of another stage that follows
/// it across communication alone made adjacent (see the file comment). Compute actions keep their
/// order; a program without such forwards is returned unchanged.
[[nodiscard]] constexpr Program group_pairs(Program program) {
  for (auto& actions : program.ranks) {
    std::vector<Action> out;
    out.reserve(actions.size());
    std::size_t i = 0;
    while (i < actions.size()) {
      const Action& f = actions[i];
      std::size_t j = i + 1;
      while (j < actions.size() && !actions[j].is_compute()) {
        ++j;
      }
      const bool pairs = f.op == Op::forward && j < actions.size() &&
                         (actions[j].op == Op::backward || actions[j].op == Op::backward_input) &&
                         actions[j].stage != f.stage;
      if (!pairs) {
        out.push_back(f);
        ++i;
        continue;
      }
      const Action& b = actions[j];
      const auto feeds_backward = [&](const Action& c) {
        return c.op == Op::recv_gradient && c.stage == b.stage && c.microbatch == b.microbatch;
      };
      for (std::size_t k = i + 1; k < j; ++k) {
        if (feeds_backward(actions[k])) {
          out.push_back(actions[k]);
        }
      }
      out.push_back(f);
      out.push_back(b);
      for (std::size_t k = i + 1; k < j; ++k) {
        if (!feeds_backward(actions[k])) {
          out.push_back(actions[k]);
        }
      }
      i = j + 1;
    }
    actions = std::move(out);
  }
  return program;
}

}  // namespace d9d::pipeline
