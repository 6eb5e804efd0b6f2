// Build-failure test: an expert count that is neither >= 1 nor d9d::dynamic.
// expect-error: d9d::parallel::ExpertParallel<NumExperts>: NumExperts must be >= 1 or d9d::dynamic
#include <d9d/parallel/policies.hpp>

using Bad = d9d::parallel::ExpertParallel<0>;

int main() { return Bad::num_experts; }
