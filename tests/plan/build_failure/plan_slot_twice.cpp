// Build-failure test: two policies for the same slot; the error names the slot and both policies.
// expect-error: d9d::Plan: two policies fill the same slot
// expect-error: <d9d::slot::precision, d9d::precision::Fp32, d9d::precision::Fp64>
// expect-error: Fix: keep one policy per slot; d9d::plan_with_t<Plan, Policy> replaces the one
#include <d9d/plan/plan.hpp>
#include <d9d/precision/policies.hpp>

using MyPlan = d9d::Plan<d9d::precision::Fp32, d9d::parallel::Replicate, d9d::precision::Fp64>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
