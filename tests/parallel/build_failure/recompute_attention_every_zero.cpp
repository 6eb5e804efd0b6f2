// Build-failure test: recomputing the attention of every 0th block means nothing.
// expect-error: d9d::recompute::Attention<K>: K must be >= 1
// expect-error: Fix: use d9d::recompute::None to keep every activation
#include <d9d/plan/plan.hpp>
#include <d9d/recompute/policies.hpp>

using MyPlan = d9d::Plan<d9d::recompute::Attention<0>>;

int main() { return MyPlan::activation_checkpointing::every_nth; }
