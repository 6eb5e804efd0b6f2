// Build-failure test: interleaved 1F1B needs a multiple of pp microbatches.
// expect-error: d9d::pipeline::Interleaved1F1B: with several stages per rank the microbatches must
// be a multiple of the pipeline degree
#include <d9d/pipeline/schedules.hpp>

using Schedule = d9d::pipeline::Interleaved1F1B<d9d::pipeline::stages_per_rank<2>,
                                                d9d::pipeline::microbatches<6>>;

int main() { return static_cast<int>(d9d::pipeline::static_program<Schedule, 4>().ranks.size()); }
