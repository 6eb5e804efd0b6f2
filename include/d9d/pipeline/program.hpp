// d9d/pipeline/program.hpp — pipeline schedules as programs: one list of actions per rank.
//
//   static_assert(d9d::pipeline::verify(d9d::pipeline::one_f_one_b(4, 8)).ok());  // at compile
//   time const auto program = d9d::pipeline::one_f_one_b(/*pp=*/4, /*microbatches=*/8); for (const
//   auto& action : program.ranks[0]) { ... }       // "0F0", "0F1", "0B0", ...
//
// An action is forward F(stage, microbatch), full backward B, backward-input I, backward-weight W,
// or a send/receive of an activation or a gradient. Builders (d9d/pipeline/builders.hpp) return
// compute-only programs; with_communication() inserts the sends and receives from the data
// dependencies. Everything here is constexpr: with static sizes a schedule is built and verified by
// the compiler, with dynamic sizes the same functions run at start-up.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace d9d::pipeline {

/// What an action does.
enum class Op : std::uint8_t {
  forward,          ///< F: the stage's forward for a microbatch
  backward,         ///< B: the full backward (input and weight gradients)
  backward_input,   ///< I: the input gradient only (the weight part is queued)
  backward_weight,  ///< W: the queued weight gradient
  send_activation,  ///< the stage's output to the next stage's rank
  recv_activation,  ///< the stage's input from the previous stage's rank
  send_gradient,    ///< the gradient of the stage's input to the previous stage's rank
  recv_gradient,    ///< the gradient of the stage's output from the next stage's rank
};

/// One step of a rank's program.
struct Action {
  Op op = Op::forward;
  int stage = 0;
  int microbatch = 0;
  int peer = -1;  ///< the other rank of a send or receive; -1 for compute

  constexpr bool operator==(const Action&) const = default;
  [[nodiscard]] constexpr bool is_compute() const {
    return op == Op::forward || op == Op::backward || op == Op::backward_input ||
           op == Op::backward_weight;
  }
};

/// Where stages live: round robin (stage s on rank s % pp) or V-shaped (rank r holds stage r and
/// stage 2 pp - 1 - r; two stages per rank).
enum class Placement : std::uint8_t { loop, v };

/// A schedule for pp ranks, stages_per_rank stages each, and a number of microbatches.
struct Program {
  int pp = 1;
  int stages_per_rank = 1;
  int microbatches = 1;
  Placement placement = Placement::loop;
  bool split_backward = false;  ///< backward as I + W instead of B
  bool forward_only = false;    ///< inference
  std::vector<std::vector<Action>> ranks;

  [[nodiscard]] constexpr int stages() const { return pp * stages_per_rank; }
};

/// The rank that holds `stage`.
[[nodiscard]] constexpr int stage_rank(Placement placement, int pp, int stage) {
  if (placement == Placement::v && stage >= pp) {
    return 2 * pp - 1 - stage;
  }
  return stage % pp;
}

/// The stages rank `rank` holds, in increasing order.
[[nodiscard]] constexpr std::vector<int> rank_stages(Placement placement, int pp,
                                                     int stages_per_rank, int rank) {
  std::vector<int> out;
  for (int s = 0; s < pp * stages_per_rank; ++s) {
    if (stage_rank(placement, pp, s) == rank) {
      out.push_back(s);
    }
  }
  return out;
}

/// "2F3": stage 2, forward, microbatch 3 (B, I, W for the backward kinds); communication as
/// "2SA3>1" / "2RA3<0" (send/receive activation, to/from rank) and "SG"/"RG" for gradients.
[[nodiscard]] inline std::string to_string(const Action& action) {
  const char* op = "?";
  switch (action.op) {
    case Op::forward:
      op = "F";
      break;
    case Op::backward:
      op = "B";
      break;
    case Op::backward_input:
      op = "I";
      break;
    case Op::backward_weight:
      op = "W";
      break;
    case Op::send_activation:
      op = "SA";
      break;
    case Op::recv_activation:
      op = "RA";
      break;
    case Op::send_gradient:
      op = "SG";
      break;
    case Op::recv_gradient:
      op = "RG";
      break;
  }
  std::string out = std::to_string(action.stage) + op + std::to_string(action.microbatch);
  if (!action.is_compute()) {
    const bool send = action.op == Op::send_activation || action.op == Op::send_gradient;
    out += (send ? ">" : "<") + std::to_string(action.peer);
  }
  return out;
}

}  // namespace d9d::pipeline
