// Build-failure test: FullyShard's float8 weight gather quantises each row on its owner rank, which
// needs per-row scales; a tensor-wide scale would span every rank's rows.
// expect-error: d9d::precision::Float8: WeightGather::float8 needs Scaling::rowwise
// expect-error: Fix: Float8<Scaling::rowwise, WeightGather::float8>, or WeightGather::compute_dtype
#include <d9d/parallel/parallelize.hpp>
#include <d9d/plan/plan.hpp>

using Precision = d9d::precision::Float8<d9d::precision::Scaling::tensorwise,
                                         d9d::precision::WeightGather::float8>;
using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<2>>, d9d::parallel::FullyShard<>, Precision>;

int main() {
  d9d::parallel::check_plan<MyPlan>();
  return 0;
}
