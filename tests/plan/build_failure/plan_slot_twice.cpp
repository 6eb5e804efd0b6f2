// Build-failure test: two policies for the same slot; the error names the slot and both policies.
// expect-error: d9d::Plan: two policies fill the same slot
// expect-error: <d9d::slot::data_parallel, d9d::parallel::Fsdp, d9d::parallel::Replicate>
// expect-error: Fix: keep one policy per slot; d9d::plan_with_t<Plan, Policy> replaces the one
#include <d9d/plan/plan.hpp>

using MyPlan = d9d::Plan<d9d::parallel::Fsdp, d9d::precision::Bf16Mixed, d9d::parallel::Replicate>;

int main() { return sizeof(MyPlan) > 0 ? 0 : 1; }
