// Build-failure test: 1F1B with fewer microbatches than pipeline stages.
// expect-error: d9d::pipeline::OneFOneB: needs microbatches >= the pipeline degree
// expect-error: Fix: raise d9d::pipeline::microbatches<N> to at least pp
#include <d9d/pipeline/schedules.hpp>

int main() {
  return static_cast<int>(
      d9d::pipeline::static_program<d9d::pipeline::OneFOneB<d9d::pipeline::microbatches<2>>, 4>()
          .ranks.size());
}
