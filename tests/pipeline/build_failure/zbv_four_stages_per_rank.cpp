// Build-failure test: ZBV places exactly two stages on each rank.
// expect-error: d9d::pipeline::ZeroBubbleV: the V schedule places exactly 2 stages on each rank
#include <d9d/pipeline/schedules.hpp>

using Schedule =
    d9d::pipeline::ZeroBubbleV<d9d::pipeline::microbatches<8>, d9d::pipeline::stages_per_rank<4>>;

int main() { return Schedule::stages_per_rank; }
