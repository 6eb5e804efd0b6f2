// Build-failure test: a user-written schedule whose program runs a backward before its forward
// fails to compile, naming the rule, the rank and the action.
// expect-error: d9d::pipeline: the schedule's program breaks a rule
// expect-error: schedule_violation<d9d::pipeline::Rule::order, 0, d9d::pipeline::Op::backward, 0,
// 1>
#include <utility>

#include <d9d/pipeline/schedules.hpp>

struct BackwardFirst {
  using d9d_slot = d9d::slot::pipeline;
  static constexpr int stages_per_rank = 1;
  static constexpr int microbatches = 2;
  static constexpr d9d::pipeline::Program build(int pp, int m) {
    auto program = d9d::pipeline::gpipe(pp, m);
    std::swap(program.ranks[0][0], program.ranks[0].back());  // 0B1 first, 0F0 last
    return program;
  }
};

int main() {
  return static_cast<int>(d9d::pipeline::static_program<BackwardFirst, 2>().ranks.size());
}
