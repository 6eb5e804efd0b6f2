// Build-failure test: DualPipeV with fewer than 2 x pp microbatches.
// expect-error: d9d::pipeline::DualPipeV: needs microbatches >= 2 x the pipeline degree
// expect-error: Fix: raise d9d::pipeline::microbatches<N> to at least 2 * pp
#include <d9d/pipeline/schedules.hpp>

int main() {
  return static_cast<int>(
      d9d::pipeline::static_program<d9d::pipeline::DualPipeV<d9d::pipeline::microbatches<6>>, 4>()
          .ranks.size());
}
